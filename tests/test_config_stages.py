"""The launcher's start stages in config.json: the scheduler and the frontend are spawned
with the workers and wait for theirs (pegainfer/config.py)."""

from __future__ import annotations

import os
import threading
import time

from pegainfer.config import (
    STAGE_LAUNCHED,
    STAGE_SCHEDULER_READY,
    STAGE_WORKERS_READY,
    EngineConfig,
)


def _config(**fields) -> EngineConfig:
    return EngineConfig(model_path="/m", served_model_name="m", **fields)


def test_a_config_written_outside_the_launcher_is_complete(tmp_path):
    _config(num_kv_blocks=8).save(str(tmp_path))
    started = time.monotonic()
    config = EngineConfig.wait_for_stage(str(tmp_path), STAGE_SCHEDULER_READY)
    assert config.num_kv_blocks == 8 and time.monotonic() - started < 1.0


def test_waiting_ends_at_the_stage_with_its_fields(tmp_path):
    run_dir = str(tmp_path)
    config = _config(start_stage=STAGE_LAUNCHED)
    config.save(run_dir)
    seen: list[EngineConfig] = []
    waiter = threading.Thread(
        target=lambda: seen.append(EngineConfig.wait_for_stage(run_dir, STAGE_SCHEDULER_READY))
    )
    waiter.start()
    config.num_kv_blocks, config.start_stage = 123, STAGE_WORKERS_READY
    config.save(run_dir)
    time.sleep(0.1)
    assert not seen  # stage 1 is not enough
    config.reasoning, config.start_stage = True, STAGE_SCHEDULER_READY
    config.save(run_dir)
    waiter.join(timeout=5)
    assert seen and seen[0].num_kv_blocks == 123 and seen[0].reasoning
    assert os.listdir(run_dir) == ["config.json"]  # written by rename, nothing left over


def test_readers_never_see_a_partial_file(tmp_path):
    run_dir = str(tmp_path)
    config = _config(start_stage=STAGE_LAUNCHED, extra={"pad": "x" * 200_000})
    config.save(run_dir)
    stop = threading.Event()
    errors: list[Exception] = []

    def read() -> None:
        while not stop.is_set():
            try:
                EngineConfig.load(run_dir)
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    for blocks in range(50):
        config.num_kv_blocks = blocks
        config.save(run_dir)
    stop.set()
    reader.join()
    assert errors == []
