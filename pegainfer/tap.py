"""`pegainfer tap`: list a running instance's processes and sockets, and show, live and
decoded, the messages flowing between them.

Every child publishes a copy of each message it sends on its PUB socket ``tap-<process>``
in the run directory (see ``pegainfer/ipc.py``). PUB sockets drop while nobody listens and
drop rather than block for a slow listener, so tapping never stops or slows the server. This
tool subscribes to them and prints one line per message.

    pegainfer tap                      # list running instances (and tap the only one)
    pegainfer tap RUN_DIR --list       # processes and sockets of one instance
    pegainfer tap RUN_DIR --from scheduler --to worker-0 --type StepPlan --count 20
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from typing import Any, TextIO

import zmq

from pegainfer import ipc, protocol
from pegainfer.manifest import MANIFEST, read_manifest

_MAX_IDS_SHOWN = 4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_instances() -> list[dict[str, Any]]:
    """Manifests of the instances running on this host for this user."""
    bases = {tempfile.gettempdir()}
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        bases.add(runtime)
    found = []
    for base in sorted(bases):
        for path in sorted(glob.glob(os.path.join(base, "pegainfer-*", MANIFEST))):
            try:
                manifest = read_manifest(os.path.dirname(path))
            except (OSError, ValueError):
                continue
            if _alive(int(manifest.get("launcher_pid", 0) or 0)):
                found.append(manifest)
    return found


def describe_instance(manifest: dict[str, Any], out: TextIO) -> None:
    print(f"run dir   {manifest['run_dir']}", file=out)
    print(f"model     {manifest.get('model')}  ({manifest.get('model_path')})", file=out)
    print(f"http      {manifest.get('http')}", file=out)
    print(f"launcher  pid {manifest.get('launcher_pid')}", file=out)
    print("processes", file=out)
    for proc in manifest.get("processes", []):
        state = "running" if _alive(proc["pid"]) else "gone"
        print(f"  {proc['name']:<28} pid {proc['pid']:<8} {state}", file=out)
    print("sockets", file=out)
    for sock in manifest.get("sockets", []):
        print(
            f"  {sock['name']:<14} {sock['pattern']:<5} bound by {sock['bound_by']:<12} "
            f"{sock['carries']}",
            file=out,
        )
    taps = tap_sockets(manifest["run_dir"])
    print(f"taps      {', '.join(sorted(taps)) or '(none yet)'}", file=out)


def tap_sockets(run_dir: str) -> dict[str, str]:
    """Process name -> address of its tap socket, for the taps present in the run dir."""
    taps = {}
    for path in glob.glob(os.path.join(run_dir, "tap-*.sock")):
        process = os.path.basename(path)[len("tap-") : -len(".sock")]
        taps[process] = f"ipc://{path}"
    return taps


def _ids(values: list[str]) -> str:
    shown = ",".join(values[:_MAX_IDS_SHOWN])
    more = len(values) - _MAX_IDS_SHOWN
    return shown + (f",+{more}" if more > 0 else "")


def summarize(msg: Any) -> str:
    """The interesting facts of one message, on one line."""
    if isinstance(msg, protocol.StepPlan):
        seqs = len(msg.seq_ids) // 4
        tokens = sum(protocol.unpack_ids(msg.num_scheduled))
        return (
            f"step={msg.step_id} batch={seqs} tokens={tokens} new={len(msg.new_seqs)} "
            f"finished={len(msg.finished_seq_ids) // 4}"
        )
    if isinstance(msg, protocol.StepResult):
        text = f"step={msg.step_id} sampled={len(msg.seq_ids) // 4}"
        if msg.logprobs or msg.prompt_logprobs:
            text += f" logprobs={len(msg.logprobs)} prompt_logprobs={len(msg.prompt_logprobs)}"
        return text + (f" error={msg.error!r}" if msg.error else "")
    if isinstance(msg, protocol.TokenOutputs):
        finished = [o.request_id for o in msg.outputs if o.finish_reason]
        return (
            f"outputs={len(msg.outputs)} requests={_ids([o.request_id for o in msg.outputs])}"
            + (f" finished={_ids(finished)}" if finished else "")
        )
    if isinstance(msg, protocol.TextOutputs):
        chars = sum(len(d.text) for d in msg.outputs)
        finished = [f"{d.request_id}:{d.finish_reason}" for d in msg.outputs if d.finish_reason]
        return (
            f"deltas={len(msg.outputs)} chars={chars} "
            f"requests={_ids([d.request_id for d in msg.outputs])}"
            + (f" finished={_ids(finished)}" if finished else "")
        )
    if isinstance(msg, protocol.GenerateRequest):
        kind = "chat" if msg.messages is not None else "prompt"
        return f"request={msg.request_id} {kind} max_tokens={msg.sampling.max_tokens}"
    if isinstance(msg, protocol.TokenizedRequest):
        return (
            f"request={msg.request_id} prompt_tokens={len(msg.prompt_token_ids) // 4} "
            f"max_tokens={msg.sampling.max_tokens}"
        )
    if isinstance(msg, protocol.AbortRequests):
        return f"requests={_ids(msg.request_ids)}"
    if isinstance(msg, protocol.RequestRejected):
        return f"request={msg.request_id} status={msg.status} {msg.message[:60]!r}"
    if isinstance(msg, protocol.EngineStats):
        return (
            f"running={msg.num_running} waiting={msg.num_waiting} "
            f"kv={100 * msg.kv_cache_usage:.1f}% steps_in_flight={msg.num_steps_in_flight}"
        )
    if isinstance(msg, protocol.ProcessReady):
        return f"name={msg.name} pid={msg.pid}"
    fields = getattr(msg, "__dataclass_fields__", {})
    return " ".join(f"{name}={getattr(msg, name)!r}"[:60] for name in fields)


def format_line(topic: bytes, data: bytes, started: float) -> tuple[str, str, str, str]:
    """(source, destination, type, printed line) of one tapped message."""
    source, _, destination = topic.decode(errors="replace").partition(">")
    try:
        msg = protocol.decode(data)
        kind, summary = type(msg).__name__, summarize(msg)
    except protocol.ProtocolError as exc:
        kind, summary = "?", f"undecodable: {exc}"
    line = (
        f"{time.monotonic() - started:9.3f}  {source:>12} -> {destination:<12} "
        f"{kind:<16} {len(data):>8}B  {summary}"
    )
    return source, destination, kind, line


def watch(
    run_dir: str,
    sources: list[str] | None,
    destinations: list[str] | None,
    kinds: list[str] | None,
    count: int,
    duration: float,
    out: TextIO,
    as_json: bool = False,
) -> int:
    taps = tap_sockets(run_dir)
    chosen = {name: addr for name, addr in taps.items() if not sources or name in sources}
    if not chosen:
        print(f"no tap sockets to read in {run_dir} (have: {sorted(taps)})", file=sys.stderr)
        return 1
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, ipc.TAP_HWM)
    for addr in chosen.values():
        sub.connect(addr)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    started = time.monotonic()
    deadline = started + duration if duration > 0 else float("inf")
    shown = 0
    print(f"tapping {', '.join(sorted(chosen))} (Ctrl-C to stop)", file=sys.stderr)
    try:
        while shown < count or count <= 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if not sub.poll(int(min(remaining, 0.5) * 1000)):
                continue
            parts = sub.recv_multipart()
            if len(parts) != 2:
                continue
            source, destination, kind, line = format_line(parts[0], parts[1], started)
            if destinations and destination not in destinations:
                continue
            if kinds and kind not in kinds:
                continue
            if as_json:
                line = json.dumps(
                    {
                        "t": round(time.monotonic() - started, 6),
                        "from": source,
                        "to": destination,
                        "type": kind,
                        "bytes": len(parts[1]),
                        "summary": line.split("B  ", 1)[-1],
                    }
                )
            print(line, file=out, flush=True)
            shown += 1
    except KeyboardInterrupt:
        pass
    finally:
        sub.close(linger=0)
        ctx.term()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pegainfer tap",
        description="Show the processes, sockets and live messages of a running pegainfer.",
    )
    parser.add_argument("run_dir", nargs="?", help="the instance's run directory")
    parser.add_argument("--list", action="store_true", help="describe the instance and exit")
    parser.add_argument(
        "--from", dest="sources", action="append", help="only messages sent by this process"
    )
    parser.add_argument(
        "--to", dest="destinations", action="append", help="only messages to this socket"
    )
    parser.add_argument("--type", dest="kinds", action="append", help="only this message type")
    parser.add_argument("--count", type=int, default=0, help="stop after N messages (0: never)")
    parser.add_argument(
        "--duration", type=float, default=0.0, help="stop after S seconds (0: never)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per message")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = sys.stdout
    run_dir = args.run_dir
    if run_dir is None:
        instances = find_instances()
        if not instances:
            print("no running pegainfer instance found", file=sys.stderr)
            return 1
        for manifest in instances:
            print(
                f"{manifest['run_dir']}  {manifest.get('model')}  {manifest.get('http')}  "
                f"launcher pid {manifest.get('launcher_pid')}",
                file=out,
            )
        if len(instances) > 1 or args.list:
            return 0
        run_dir = instances[0]["run_dir"]
    if not os.path.isfile(os.path.join(run_dir, MANIFEST)):
        print(f"{run_dir} is not a pegainfer run directory (no {MANIFEST})", file=sys.stderr)
        return 1
    # With --json, stdout carries only the messages.
    describe_instance(read_manifest(run_dir), sys.stderr if args.json else out)
    if args.list:
        return 0
    return watch(
        run_dir,
        args.sources,
        args.destinations,
        args.kinds,
        args.count,
        args.duration,
        out,
        args.json,
    )


if __name__ == "__main__":
    sys.exit(main())
