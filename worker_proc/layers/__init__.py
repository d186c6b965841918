"""Model building blocks: parallel linear layers, embeddings, norms, rotary, attention."""
