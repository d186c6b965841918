"""Model families, one file each; registry.py maps config.json architectures to them."""
