"""The `pegainfer` command line."""

from __future__ import annotations

import argparse
import os
import re
import sys

from frontend_proc.chat_template import template_from_option
from frontend_proc.sampling_defaults import parse_override
from frontend_proc.tool_calls import TOOL_CALL_PARSERS
from pegainfer.config import REASONING_PARSERS, EngineConfig
from pegainfer.hf_config import parse_hf_overrides

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4GiB', '512M', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4GiB or 512MiB)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pegainfer",
        description="Serve a language model through an OpenAI-compatible HTTP API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL", help="the same as --model-path"
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model-path",
        default=None,
        help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json), "
        "or a Hub name (Qwen/Qwen3-4B) already in the local Hugging Face cache. "
        "Default: the embedded SmolLM2-135M-Instruct, converted once into the cache directory.",
    )
    model.add_argument(
        "--revision",
        default="main",
        help="branch, tag or commit of a model given by its Hub name, as cached",
    )
    model.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name in the API (default: the directory's, or the Hub name); more "
        "names are accepted in requests too, the first is the one responses give",
    )
    model.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    model.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling settings of requests that leave them out: 'auto' reads the "
        "model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty), 'none' keeps the API's (temperature 1, no filters), or a "
        "folder or file to read instead",
    )
    model.add_argument(
        "--override-generation-config",
        default="",
        help="JSON object of default sampling settings, over the file's, e.g. '{\"temperature\": 0.7}'",
    )
    model.add_argument(
        "--chat-template",
        default="",
        help="chat template to render conversations with, instead of the model's: a Jinja "
        "file, or the template itself",
    )
    model.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSERS,
        help="how chat outputs' <think> blocks become reasoning_content: 'auto' where the "
        "model writes them (its tokenizer and chat template know the tags), 'none' never "
        "(they stay in the content), 'qwen3' or 'deepseek_r1' always",
    )
    model.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_CALL_PARSERS,
        help="the tool-call format: 'auto' parses <tool_call> blocks (Hermes, as Qwen2.5 "
        "and Qwen3 write them) where the chat template teaches them; 'hermes' or 'qwen25' "
        "stops the start if it does not",
    )
    model.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for other servers' command lines: tool_choice 'auto' is always served "
        "where the model has a tool-call format",
    )
    model.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most top logprobs a token may ask for (logprobs, top_logprobs, "
        "prompt_logprobs); -1: the whole vocabulary",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="context length in tokens, prompt plus output (0: what the model's positions "
        "cover, its rope scaling included)",
    )
    model.add_argument(
        "--hf-overrides",
        default="",
        help="JSON object of keys laid over the model's config.json, e.g. "
        "'{\"max_position_embeddings\": 65536}'",
    )
    model.add_argument(
        "--rope-scaling",
        default="",
        help="JSON object replacing the model's rope scaling, e.g. Qwen3 at 128k tokens: "
        '\'{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}\'',
    )

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="interface to bind the HTTP port to")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--num-tokenizers", type=int, default=1, help="tokenizer processes")
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    add_limit_arguments(server)

    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda")
    engine.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests running in one batch"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="most tokens in one step; longer prompts are prefilled in chunks (0: automatic)",
    )
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    engine.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=0,
        help="KV-cache size on CPU, e.g. 2GiB (0: automatic)",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache",
    )
    engine.add_argument(
        "--no-prefix-cache",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off",
    )
    engine.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="serve waiting requests first come first served, or by their 'priority' "
        "(lower first; the last to be preempted), then arrival",
    )
    engine.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=10.0,
        help="seconds a structured-output constraint may take to compile before its request "
        "is refused with a 400 (0: no limit)",
    )
    engine.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="worker ranks (GPUs) the model is sharded over, on all nodes together",
    )
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument(
        "--no-overlap",
        action="store_true",
        help="no overlapped scheduling: plan each step only after the previous one's tokens "
        "are back (outputs are the same; for debugging and measurement)",
    )
    engine.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    add_node_arguments(parser)
    return parser


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    nodes = parser.add_argument_group(
        "several hosts", "tensor parallelism across nodes; see README 'Tensor parallelism'"
    )
    nodes.add_argument("--nnodes", type=int, default=1, help="hosts the ranks are spread over")
    nodes.add_argument(
        "--node-rank", type=int, default=0, help="this host's index; 0 runs the server"
    )
    nodes.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="an address of node 0, on the interface the nodes share; node 0 binds its "
        "TCP ports (rendezvous, node link, step plans) on this address only",
    )
    nodes.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="first of the TCP ports node 0 binds: master-port up to "
        "master-port + 1 + tensor-parallel-size",
    )
    nodes.add_argument(
        "--dist-interface",
        default="",
        help="network interface for gloo/NCCL traffic (sets GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME; default: the one that routes to --master-addr)",
    )
    nodes.add_argument(
        "--headless",
        action="store_true",
        help="on nodes 1 and up: run only this node's worker ranks, driven by node 0",
    )


def node_options(args: argparse.Namespace) -> dict:
    return {
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "dist_interface": args.dist_interface,
        "headless": args.headless,
    }


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    for name in ("port", "max_num_seqs", "num_tokenizers", "block_size", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"pegainfer: --{name.replace('_', '-')} must be at least 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SystemExit("pegainfer: --gpu-memory-utilization must be in (0, 1]")
    if args.max_logprobs < -1:
        raise SystemExit("pegainfer: --max-logprobs must be at least -1")
    if not args.grammar_compile_timeout >= 0:  # NaN too
        raise SystemExit("pegainfer: --grammar-compile-timeout must be at least 0")
    try:
        override = parse_override(args.override_generation_config)
        hf_overrides = parse_hf_overrides(args.hf_overrides, args.rope_scaling)
        chat_template = template_from_option(args.chat_template) if args.chat_template else ""
    except ValueError as exc:
        raise SystemExit(f"pegainfer: {exc}") from None
    model_path = args.model_path
    if args.model is not None:
        if model_path is not None and model_path != args.model:
            raise SystemExit(
                f"pegainfer: two models given: {args.model} and --model-path {model_path}"
            )
        model_path = args.model
    names = args.served_model_name or []
    if model_path is None and len(names) > 1 and os.path.isdir(names[-1]):
        # "--served-model-name a /models/x" took the model for a name.
        raise SystemExit(
            f"pegainfer: {names[-1]} is a directory among the served model names; give the "
            "model first (pegainfer MODEL --served-model-name ...) or with --model-path"
        )
    return EngineConfig(
        model_path=model_path or "",
        served_model_name=args.served_model_name[0] if args.served_model_name else "",
        served_model_aliases=list(args.served_model_name or [])[1:],
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        hf_overrides=hf_overrides,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_tokenizers=args.num_tokenizers,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        grammar_compile_timeout=args.grammar_compile_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        no_overlap=args.no_overlap,
        seed=args.seed,
        generation_config=args.generation_config,
        generation_config_override=override,
        chat_template=chat_template,
        revision=args.revision,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        max_logprobs=args.max_logprobs,
        log_level=args.log_level,
        **node_options(args),
    )


def add_limit_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        help="accept requests only with 'Authorization: Bearer KEY' (repeat for several keys; "
        "/health and /metrics stay open)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default="64MiB",
        help="largest request body; larger ones get 413",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=-1,
        help="refuse generation requests (503 with Retry-After) while this many wait (-1: off)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds to let requests in flight finish before aborting them",
    )
    group.add_argument(
        "--watchdog-timeout",
        type=float,
        default=300.0,
        help="a step running longer than this dumps every process's stack and stops the "
        "server (0: off)",
    )


def limits_from_args(args: argparse.Namespace) -> dict:
    """The frontend's and launcher's limits, carried in EngineConfig.extra."""
    return {
        "api_keys": [key for key in args.api_keys if key],
        "max_request_bytes": args.max_request_bytes,
        "max_waiting_requests": args.max_waiting_requests,
        "shutdown_timeout": max(0.0, args.shutdown_timeout),
        "watchdog_timeout": max(0.0, args.watchdog_timeout),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "tap":
        from pegainfer.tap import main as tap_main

        sys.exit(tap_main(argv[1:]))
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    config.extra.update(limits_from_args(args))
    from pegainfer.launcher import serve

    sys.exit(serve(config))


if __name__ == "__main__":
    main()
