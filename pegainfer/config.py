"""The engine configuration every process reads from the run directory.

The launcher resolves the command line and the model's config.json into one ``EngineConfig``
and writes it as ``config.json`` in the run directory; each child loads it from there, so a
child started by hand against a running tree sees the same settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from pegainfer.hf_config import check_rope_scaling, max_context_len, read_hf_config

# Lets --max-model-len pass the model's positions, as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN.
ALLOW_LONG_ENV = "PEGAINFER_ALLOW_LONG_MAX_MODEL_LEN"


# --reasoning-parser's choices: the two names other servers give Qwen3's and DeepSeek-R1's
# <think> blocks, which pegainfer reads alike.
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")


@dataclass
class ModelInfo:
    """What the light processes need to know about the model, read from its config.json."""

    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    num_hidden_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    # The longest context the positions cover (pegainfer/hf_config.py: YaRN's factor
    # included); 0 in a config written before it existed: max_position_embeddings then.
    max_context_len: int = 0

    def longest_context(self) -> int:
        return self.max_context_len or self.max_position_embeddings


# The launcher's start, as recorded in config.json. The scheduler and the frontend are spawned
# with the workers, so that their interpreters and imports overlap the model load; each then
# waits for the stage it needs (EngineConfig.wait_for_stage).
STAGE_LAUNCHED = 0
STAGE_WORKERS_READY = 1  # num_kv_blocks is set: the scheduler may start
STAGE_SCHEDULER_READY = 2  # the scheduler is up, reasoning is known: the frontend may serve


@dataclass
class EngineConfig:
    model_path: str
    served_model_name: str
    # More names requests may give the model by (--served-model-name's others).
    served_model_aliases: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_num_seqs: int = 256
    max_model_len: int = 0  # 0: the longest context the model's positions cover
    # Keys laid over the model's config.json (--hf-overrides, --rope-scaling).
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    max_num_batched_tokens: int = 0  # 0: derived from max_model_len and max_num_seqs
    num_tokenizers: int = 1
    block_size: int = 16
    kv_cache_memory: int = 0  # bytes; 0: derived (CPU) or profiled (GPU)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # "fcfs": first come, first served; "priority": by each request's priority (lower
    # first), then arrival.
    scheduling_policy: str = "fcfs"
    # Seconds a constraint may compile before its request is refused (0: no limit).
    grammar_compile_timeout: float = 10.0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    no_overlap: bool = False  # one step in flight: plan only after the last result
    seed: int = 0
    # Where a request's omitted sampling fields come from: "auto" (the model's
    # generation_config.json), "none", or a path; the override's settings win over the file's.
    generation_config: str = "auto"
    generation_config_override: dict[str, Any] = field(default_factory=dict)
    # A chat template's source, over the model's (--chat-template); empty: the model's.
    chat_template: str = ""
    # The revision of a model named by its Hugging Face Hub id (looked up in the local cache).
    revision: str = "main"
    # "auto": chat outputs split at </think> where the model reasons in think blocks; "none":
    # never; "qwen3" or "deepseek_r1": always (the tokenizer must have the tags).
    reasoning_parser: str = "auto"
    # "auto": tool calls parsed where the chat template writes <tool_call> blocks; a named
    # parser ("hermes", "qwen25") requires that it does.
    tool_call_parser: str = "auto"
    # The most top logprobs a token may come with; -1: the whole vocabulary.
    max_logprobs: int = 20
    # Set by the launcher: the resolved defaults that differ from the API's neutral ones.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    run_dir: str = ""
    num_kv_blocks: int = 0  # set by the launcher: the fewest any worker rank reported
    # Set by the launcher from tokenizer-0's report: the model writes <think> blocks.
    reasoning: bool = False
    # How far the launcher's start has come (STAGE_*). A config written by anyone else is
    # complete: the launcher alone writes the earlier stages.
    start_stage: int = STAGE_SCHEDULER_READY
    model: ModelInfo | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Several hosts (see pegainfer/multinode.py): node 0 runs the tree, node k > 0 is
    # headless and runs only its share of the worker ranks.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # an address of node 0; every TCP port binds it only
    master_port: int = 29500  # and the ports above it (multinode.py lists them)
    dist_interface: str = ""  # network interface of gloo/NCCL ("": derived)
    headless: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        raw = json.loads(text)
        model = raw.pop("model", None)
        config = cls(**raw)
        config.model = ModelInfo(**model) if model else None
        return config

    def save(self, run_dir: str) -> str:
        """Write ``config.json`` whole, by rename: a child reading it while it is rewritten
        sees the old one or the new one, never a part."""
        path = os.path.join(run_dir, "config.json")
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            f.write(self.to_json())
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, run_dir: str) -> EngineConfig:
        with open(os.path.join(run_dir, "config.json")) as f:
            return cls.from_json(f.read())

    @classmethod
    def wait_for_stage(cls, run_dir: str, stage: int, poll_s: float = 0.005) -> EngineConfig:
        """Load the config once the launcher's start has reached ``stage``. No deadline: a
        child never outlives its launcher (pegainfer/process.py), which stops the tree if
        the start fails."""
        while True:
            config = cls.load(run_dir)
            if config.start_stage >= stage:
                return config
            time.sleep(poll_s)


def read_model_info(model_path: str, overrides: dict[str, Any] | None = None) -> ModelInfo:
    """Read the architecture facts the scheduler, tokenizer and frontend need, without torch."""
    hf = read_hf_config(model_path, overrides)
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError(f"{model_path}/config.json names no architectures")
    check_rope_scaling(hf)
    eos = hf.get("eos_token_id")
    generation_config = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            eos = json.load(f).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    num_heads = hf["num_attention_heads"]
    return ModelInfo(
        architecture=architectures[0],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        eos_token_ids=eos_ids,
        bos_token_id=hf.get("bos_token_id"),
        num_hidden_layers=hf["num_hidden_layers"],
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        hidden_size=hf["hidden_size"],
        max_context_len=max_context_len(hf),
    )


def finalize(config: EngineConfig) -> EngineConfig:
    """Fill the derived fields once the model's info is known."""
    assert config.model is not None
    longest = config.model.longest_context()
    if config.max_model_len <= 0:
        config.max_model_len = longest
    elif config.max_model_len > longest and os.environ.get(ALLOW_LONG_ENV) != "1":
        raise ValueError(
            f"--max-model-len {config.max_model_len} is longer than the {longest} positions "
            "the model covers (max_position_embeddings, with its rope scaling): past them "
            "its outputs are unreliable. Extend the context with rope scaling, e.g. "
            '--rope-scaling \'{"rope_type": "yarn", "factor": 4.0, '
            '"original_max_position_embeddings": 32768}\' for Qwen3, or set '
            f"{ALLOW_LONG_ENV}=1 to serve it anyway"
        )
    if config.max_num_batched_tokens <= 0:
        config.max_num_batched_tokens = max(2048, min(config.max_model_len, 8192))
    return config
