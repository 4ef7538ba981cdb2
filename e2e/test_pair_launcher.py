"""The pair launcher's command line and server settings (no vLLM needed)."""

from __future__ import annotations

import json
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
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
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
    pair.stop()
    assert tmp_path.exists()
