"""The pair launcher's command line and server settings (no vLLM needed)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

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


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` (Linux ``/proc``)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _allowed(pid: int) -> dict[str, set[int]]:
    """Each thread of ``pid`` (``name/tid``) and the CPUs it may run on."""
    threads: dict[str, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            status = dict(
                line.split(":\t", 1) for line in (task / "status").read_text().splitlines()
            )
        except OSError:
            continue
        cores: set[int] = set()
        for part in status["Cpus_allowed_list"].strip().split(","):
            first, _, last = part.partition("-")
            cores.update(range(int(first), int(last or first) + 1))
        threads[f"{status['Name'].strip()}/{task.name}"] = cores
    return threads


@pytest.mark.timeout(600)  # the session's pair may start here
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux /proc")
def test_no_thread_of_a_bound_server_is_moved_off_its_core(vllm_pair: Any) -> None:
    """vLLM's NIXL worker on CPU re-binds its calling thread (the model's) to the
    host's last core; the servers' ``sitecustomize`` keeps it on the server's own core,
    or a prefill on core 0 waits for the decoder decoding on core 1."""
    for server in vllm_pair.servers:
        assert server.spec.cpu is not None and server._process is not None
        threads = {
            name: cores
            for pid in _descendants(server._process.pid)
            for name, cores in _allowed(pid).items()
        }
        assert any(name.startswith("VLLM::Worker") for name in threads), sorted(threads)
        off = {
            name: sorted(cores) for name, cores in threads.items() if server.spec.cpu not in cores
        }
        assert not off, f"{server.spec.name} (core {server.spec.cpu}): {off}"


def test_a_bound_servers_affinity_calls_stay_on_its_cores(vllm_python: Path) -> None:
    """With the servers' ``PYTHONPATH`` and a bound core, a thread asked onto another
    core stays on the bound one; an unbound server's calls pass unchanged."""
    probe = "import os; os.sched_setaffinity(0, {0, 1}); print(sorted(os.sched_getaffinity(0)))"
    for bind, expected in (("0", "[0]"), ("", str(sorted({0, 1} & os.sched_getaffinity(0))))):
        env = {**os.environ, "PYTHONPATH": str(pair_module.SITE_DIR)}
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        done = subprocess.run(
            [str(vllm_python), "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == expected, (bind, done.stdout)
