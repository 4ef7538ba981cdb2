"""The pair launcher's command line and server settings (no vLLM needed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import pair_module


def test_help_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        pair_module.main(["--help"])
    assert exit_info.value.code == 0
    assert "--small-decoder" in capsys.readouterr().out


def test_missing_python_and_model_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDO_E2E_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("PDO_E2E_VLLM_MODEL", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        pair_module.main([])
    assert exit_info.value.code == 2


def test_servers_get_their_own_ports_cores_and_nixl_settings(tmp_path: Path) -> None:
    config = pair_module.PairConfig(
        python=Path("py"),
        model=Path("model"),
        small_decoder=True,
        global_threshold=0.3,
        prefiller_args=("--seed", "7"),
    )
    pair = pair_module.VLLMPair(config, workdir=tmp_path)
    prefiller, decoder = pair.servers
    assert len({prefiller.port, decoder.port, prefiller.side_channel_port}) == 3

    argv = decoder.argv()
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "engine_id": decoder.engine_id,
    }
    assert decoder.engine_id != prefiller.engine_id
    assert argv[argv.index("--global-cache-hit-threshold") + 1] == "0.3"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "24"
    assert "--num-gpu-blocks-override" not in prefiller.argv()
    assert prefiller.argv()[-2:] == ["--seed", "7"]

    env = decoder.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert prefiller.env()["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(decoder.side_channel_port)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))
    assert env["PYTHONPATH"] == str(pair_module.SITE_DIR)
    assert (pair_module.SITE_DIR / "sitecustomize.py").is_file()
    pair.stop()
    assert tmp_path.exists()


def _kv_configs(tmp_path: Path, connector: str) -> list[dict[str, object]]:
    config = pair_module.PairConfig(python=Path("py"), model=Path("model"), connector=connector)
    pair = pair_module.VLLMPair(config, workdir=tmp_path)
    configs = []
    for server in pair.servers:
        argv = server.argv()
        configs.append(json.loads(argv[argv.index("--kv-transfer-config") + 1]))
    return configs


def test_nixl_push_is_the_push_connector_on_cpu_buffers(tmp_path: Path) -> None:
    for kv in _kv_configs(tmp_path, "nixl-push"):
        assert kv["kv_connector"] == "NixlPushConnector"
        assert (kv["kv_role"], kv["kv_buffer_device"]) == ("kv_both", "cpu")


def test_example_servers_share_one_storage_folder(tmp_path: Path) -> None:
    prefiller, decoder = _kv_configs(tmp_path, "example")
    assert prefiller["kv_connector"] == decoder["kv_connector"] == "ExampleConnector"
    path = prefiller["kv_connector_extra_config"]
    assert path == decoder["kv_connector_extra_config"]
    assert path == {"shared_storage_path": str(tmp_path / "shared-kv")}


def test_multi_composes_its_children_in_order(tmp_path: Path) -> None:
    for kv in _kv_configs(tmp_path, "multi:nixl,example"):
        assert kv["kv_connector"] == "MultiConnector"
        assert (kv["kv_role"], kv["kv_buffer_device"]) == ("kv_both", "cpu")
        extra = kv["kv_connector_extra_config"]
        assert isinstance(extra, dict)
        children = extra["connectors"]
        assert [c["kv_connector"] for c in children] == ["NixlConnector", "ExampleConnector"]
        assert all(c["kv_role"] == "kv_both" for c in children)
        assert children[1]["kv_connector_extra_config"] == {
            "shared_storage_path": str(tmp_path / "shared-kv")
        }


def test_an_unknown_connector_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mooncake"):
        _kv_configs(tmp_path, "mooncake")
    with pytest.raises(SystemExit):
        pair_module.main(["--python", "py", "--model", "m", "--connector", "lmcache"])


def test_a_failed_start_reports_the_root_cause_above_the_tail(tmp_path: Path) -> None:
    config = pair_module.PairConfig(python=Path("py"), model=Path("model"))
    decoder = pair_module.VLLMPair(config, workdir=tmp_path).decoder
    decoder.workdir.mkdir(parents=True)
    cause = "(Worker pid=7) ERROR [executor.py:1] RuntimeError: Cannot access accelerator device"
    quoted = (
        "(APIServer pid=5) WARNING 11-28 19:55:35 [system_utils.py:255] Found ulimit of 20000 "
        "... This can cause fd limit errors like `OSError: [Errno 24] Too many open files`."
    )
    lines = [quoted, cause, cause, *(f"INFO line {i}" for i in range(100))]
    lines.append("RuntimeError: Engine core initialization failed. See root cause above.")
    decoder.log_path.write_text("\n".join(lines))
    assert decoder.errors() == [
        "RuntimeError: Cannot access accelerator device",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    report = decoder.report()
    assert report.index("Cannot access accelerator") < report.index("INFO line 99")
    assert "INFO line 10\n" not in report  # only the tail of the rest


PROBE = """
import nixl._api as api
real, seen = api.nixlBind.nixlAgent, []
api.nixlBind.nixlAgent = lambda name, config: (seen.append(config), real(name, config))[1]
api.nixl_agent("probe", api.nixl_agent_config(num_threads=4))
print(seen[0].useProgThread, seen[0].pthrDelay)
"""


def test_the_servers_nixl_progress_thread_waits_between_polls(vllm_python: Path) -> None:
    """In the vLLM venv, with the servers' ``PYTHONPATH``, a NIXL agent made as vLLM makes
    one gets a progress-thread delay (nixl asks for none: its thread would spin)."""
    env = {**os.environ, "PYTHONPATH": str(pair_module.SITE_DIR)}
    env.pop("PDO_E2E_NIXL_PROGRESS_DELAY_US", None)
    done = subprocess.run(
        [str(vllm_python), "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["True", "1000"]
