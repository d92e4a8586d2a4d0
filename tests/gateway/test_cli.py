"""The `tiergate` command: settings from env and flags, `migrate`, `serve --demo`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli import main, settings_from_args
from gateway.migrate import current_revision, head_revisions
from gateway.settings import Settings, SettingsError, settings_from_env
from tests.conftest import postgres_url_named
from tests.gateway.conftest import output_until_started, reap, run_cli

ROOT = Path(__file__).resolve().parents[2]


def test_settings_defaults_env_and_flags(tmp_path: Path) -> None:
    defaults = settings_from_env({})
    assert (defaults.host, defaults.port, defaults.model, defaults.device) == (
        "127.0.0.1",
        8000,
        "tiny-random",
        "auto",
    )
    assert defaults.db_url == f"sqlite+aiosqlite:///{Path('.tiergate/tiergate.db').resolve()}"
    assert defaults.redis_url is None
    assert defaults.is_embedded_db
    env = {
        "TIERGATE_DATA_DIR": str(tmp_path),
        "TIERGATE_PORT": "9001",
        "TIERGATE_MAX_BODY_BYTES": "4096",
        "TIERGATE_REDIS_URL": "",  # empty counts as unset
    }
    from_env = settings_from_env(env)
    assert from_env.port == 9001
    assert from_env.max_body_bytes == 4096
    assert from_env.redis_url is None
    assert from_env.db_url == f"sqlite+aiosqlite:///{tmp_path / 'tiergate.db'}"
    # A flag wins over the environment; a flag left out keeps it.
    flagged = from_env.with_overrides(port=9002, host=None, data_dir=tmp_path / "other")
    assert (flagged.port, flagged.host) == (9002, "127.0.0.1")
    assert flagged.db_url.endswith("other/tiergate.db")
    postgres = flagged.with_overrides(database_url="postgresql+asyncpg://u@h/db")
    assert not postgres.is_embedded_db


@pytest.mark.parametrize(
    "env",
    [
        {"TIERGATE_PORT": "eighty"},
        {"TIERGATE_PORT": "70000"},
        {"TIERGATE_DEVICE": "tpu"},
        {"TIERGATE_DATABASE_URL": "garbage"},
        {"TIERGATE_DATABASE_URL": "sqlite:///no-async-driver.db"},
        # Dialects SQLAlchemy does not know: a traceback before, from loading the plugin.
        {"TIERGATE_DATABASE_URL": "postgres://u@127.0.0.1/db"},
        {"TIERGATE_DATABASE_URL": "sqlite3:///x.db"},
        {"TIERGATE_REDIS_URL": "notaurl"},
        {"TIERGATE_MAX_MODEL_LEN": "0"},
        {"TIERGATE_KV_CACHE_BYTES": "-5"},
        {"TIERGATE_MAX_NUM_SEQS": "0"},
        {"TIERGATE_BATCH_MAX_LINES": "0"},
        {"TIERGATE_MAX_FILE_BYTES": "-5"},
        {"TIERGATE_TENANT_FILE_BYTES": "0"},
        {"TIERGATE_BATCH_LEASE_S": "nan"},
        {"TIERGATE_BATCH_LEASE_S": "-1"},
        {"TIERGATE_SLOT_WAIT_QUANTILE": "1"},
        {"TIERGATE_SLOT_WAIT_QUANTILE": "0"},
        {"TIERGATE_SLOT_WAIT_QUANTILE": "nan"},
        {"TIERGATE_SLOT_WAIT_QUANTILE": "most"},
        # A database path redis-py cannot read was taken as db 0: another deployment's.
        {"TIERGATE_REDIS_URL": "redis://127.0.0.1:6379/9x"},
        {"TIERGATE_REDIS_URL": "redis://127.0.0.1:6379/abc"},
        {"TIERGATE_REDIS_URL": "rediss://127.0.0.1:6379/-1"},
        {"TIERGATE_REDIS_URL": "redis://127.0.0.1:6379/0?db=x"},
        # A database no other connection shares: the migrated one was gone at start.
        {"TIERGATE_DATABASE_URL": "sqlite+aiosqlite:///:memory:"},
        {"TIERGATE_DATABASE_URL": "sqlite+aiosqlite://"},
        {"TIERGATE_DATABASE_URL": "sqlite+aiosqlite:///file:x?mode=memory&uri=true"},
        # Tokens no client can send as they are (one with a space, a non-ASCII one that
        # passed or not by the client's header encoding) or guess in a few tries.
        {"TIERGATE_ADMIN_TOKEN": "has space in the middle"},
        {"TIERGATE_ADMIN_TOKEN": "ünïcode-admin-token-of-length"},
        {"TIERGATE_ADMIN_TOKEN": "short"},
    ],
)
def test_bad_settings_are_reported(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError):
        settings_from_env(env)


def test_a_refused_redis_url_is_printed_without_its_password() -> None:
    for url in ("redis://:hunter2-secret@127.0.0.1:6379/9x", "http://:hunter2-secret@h/0"):
        with pytest.raises(SettingsError) as refused:
            settings_from_env({"TIERGATE_REDIS_URL": url})
        assert "hunter2" not in str(refused.value)
        assert "***" in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379",
        "redis://127.0.0.1:6379/",
        "redis://127.0.0.1:6379/15",
        "rediss://:secret@example.com:6380/2",
        "redis://127.0.0.1:6379?db=3",
        "unix:///var/run/redis.sock?db=4",
    ],
)
def test_redis_urls_that_name_their_database_plainly_are_taken(url: str) -> None:
    assert settings_from_env({"TIERGATE_REDIS_URL": url}).redis_url == url


def test_a_flag_wins_over_a_bad_variable_it_replaces(monkeypatch, tmp_path: Path) -> None:
    """The variable a flag overrides is not read, so a stale or broken one in the
    environment does not stop a command that names the value it wants."""
    from gateway.cli import _parser

    monkeypatch.setenv("TIERGATE_PORT", "abc")
    monkeypatch.setenv("TIERGATE_DEVICE", "gpu")
    args = _parser().parse_args(["serve", "--port", "8204", "--device", "cpu"])
    settings = settings_from_args(args)
    assert (settings.port, settings.device) == (8204, "cpu")
    # A variable no flag replaces is still checked.
    monkeypatch.setenv("TIERGATE_MAX_NUM_SEQS", "0")
    with pytest.raises(SettingsError, match="max_num_seqs"):
        settings_from_args(args)


def test_an_unknown_database_dialect_is_one_message(capsys) -> None:
    assert main(["migrate", "--database-url", "postgres://u@127.0.0.1/db"]) == 2
    err = capsys.readouterr().err
    assert "must use sqlite+aiosqlite or postgresql+asyncpg, not postgres" in err
    assert "Traceback" not in err


def test_a_maintenance_command_leaves_a_missing_data_dir_alone(tmp_path: Path, capsys) -> None:
    """It created the directory and an empty database file, then asked for a migration."""
    missing = tmp_path / "no" / "such"
    argv = ["usage", "rebuild-rollup", "--start", "2025-06-01", "--end", "2025-06-02"]
    assert main([*argv, "--data-dir", str(missing)]) == 2
    assert "no database at" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_bad_environment_exits_2_with_a_message(monkeypatch, capsys) -> None:
    monkeypatch.setenv("TIERGATE_PORT", "eighty")
    assert main(["migrate"]) == 2
    assert "TIERGATE_PORT" in capsys.readouterr().err


def test_flags_mirror_settings(monkeypatch, tmp_path: Path) -> None:
    from gateway.cli import _parser

    monkeypatch.setenv("TIERGATE_PORT", "9100")
    args = _parser().parse_args(
        ["serve", "--data-dir", str(tmp_path), "--device", "cpu", "--max-body-bytes", "2048"]
    )
    settings = settings_from_args(args)
    assert isinstance(settings, Settings)
    assert (settings.port, settings.device, settings.max_body_bytes) == (9100, "cpu", 2048)
    assert settings.data_dir == tmp_path


def test_serve_has_a_flag_for_every_setting_of_the_environment(tmp_path: Path) -> None:
    """README: each TIERGATE_* setting has a flag of the same name that wins over it."""
    from gateway.cli import _parser
    from gateway.settings import _ENV

    sample = {int: "4096", float: "2.5", Path: str(tmp_path), str: "cpu"}
    special = {
        "database_url": f"sqlite+aiosqlite:///{tmp_path}/t.db",
        "redis_url": "redis://127.0.0.1:6379/3",
        "slot_wait_quantile": "0.9",  # a probability
        "admin_token": "an-admin-token-of-32-characters",
    }
    argv = ["serve"]
    expected = {}
    for var, (name, parse) in _ENV.items():
        flag = "--" + var.removeprefix("TIERGATE_").lower().replace("_", "-")
        raw = special.get(name, sample[parse])
        argv += [flag, raw]
        expected[name] = parse(raw)
    settings = settings_from_args(_parser().parse_args(argv))
    for name, value in expected.items():
        assert getattr(settings, name) == value, name


def test_migrate_upgrades_the_configured_database(database_url: str) -> None:
    result = run_cli("migrate", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    assert current_revision(database_url) == head_revisions()[0]
    assert "newest revision" in result.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def _start_demo(tmp_path: Path, port: int, **env: str) -> tuple[subprocess.Popen, str]:
    """`tiergate serve --demo` on `port`, and its output up to the end of start-up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--demo", "--port", str(port)],
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "TIERGATE_DATA_DIR": str(tmp_path),
            "TIERGATE_DEVICE": "cpu",
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, output_until_started(proc)


def test_serve_demo_prints_working_keys(tmp_path: Path) -> None:
    port = _free_port()
    proc, output = _start_demo(tmp_path, port, TIERGATE_MAX_MODEL_LEN="256")
    try:
        # What start-up built is out of the collector's way before the first request.
        frozen = re.search(r"start-up heap frozen: (\d+) objects", output)
        assert frozen is not None, output
        assert int(frozen.group(1)) > 10_000
        keys = dict(re.findall(r"tier=(\w+)\s+(tg-[A-Za-z0-9_-]+)", output))
        assert set(keys) == {"priority", "interactive", "batch"}, output
        assert re.search(r"Admin token \(generated.*\): \S{20,}", output)
        assert f"curl http://127.0.0.1:{port}/v1/chat/completions" in output
        assert "from openai import OpenAI" in output
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=keys["batch"], max_retries=0
        )
        reply = client.chat.completions.create(
            model="tiny-random", messages=[{"role": "user", "content": "Hello"}], max_tokens=3
        )
        assert reply.service_tier == "batch"
        assert reply.usage.completion_tokens >= 1
        # The printed examples run as printed, pasted into a shell.
        for start, end in (("curl ", "}'\n"), ("python - <<'EOF'", "\nEOF\n")):
            snippet = output[output.index(start) : output.index(end, output.index(start))]
            snippet += end
            shell_env = {**os.environ, "PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin"}
            ran = subprocess.run(
                ["bash", "-c", snippet], capture_output=True, text=True, timeout=60, env=shell_env
            )
            assert ran.returncode == 0, (snippet, ran.stdout, ran.stderr)
            assert "completion_tokens" in ran.stdout or '"choices"' in ran.stdout, ran.stdout
        with socket.create_connection(("127.0.0.1", port)) as raw:
            raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            raw.recv(1024)
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=30)[0]
    assert (tmp_path / "tiergate.db").is_file()
    # Logs off a terminal are JSON lines, uvicorn's own included (they were plain text
    # in the same stream).
    server_lines = [
        line
        for line in (output + rest).splitlines()
        if any(m in line for m in ("Started server", "Invalid HTTP request", "Shutting down"))
    ]
    assert len(server_lines) >= 3, output + rest
    for line in server_lines:
        assert json.loads(line)["logger"].startswith("uvicorn"), line


def test_a_second_serve_on_the_same_data_dir_is_refused(tmp_path: Path) -> None:
    # Each would keep its own in-memory queue and limits: a tenant would get twice its
    # limits, and neither process would see the other's queue.
    port = _free_port()
    proc, _ = _start_demo(tmp_path, port, TIERGATE_MAX_MODEL_LEN="256")
    try:
        second = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(_free_port())],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "TIERGATE_DATA_DIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert f"another tiergate serve (pid {proc.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (
            ["migrate"],
            {"TIERGATE_DATABASE_URL": "postgresql+asyncpg://u@127.0.0.1:1/x"},
            "cannot reach the database",
        ),
        (
            ["migrate"],
            {"TIERGATE_DATABASE_URL": postgres_url_named("no_such_database_here")},
            'database "no_such_database_here" does not exist',
        ),
        (["serve"], {"TIERGATE_REDIS_URL": "redis://127.0.0.1:1/0"}, "cannot reach Redis"),
        (["serve", "--model", "/nonexistent"], {}, "checkpoint directory"),
        (["worker", "--redis-url", "redis://127.0.0.1:1/0"], {}, "cannot reach Redis"),
        (["serve"], {"TIERGATE_METRICS_TOP_TENANTS": "abc"}, "TIERGATE_METRICS_TOP_TENANTS"),
        # Two blocks of tiny-random: an engine that would start and never take a request.
        (["serve"], {"TIERGATE_KV_CACHE_BYTES": str(2 * 16384)}, "at least 3 are needed"),
        # Past int64 in torch's size arithmetic.
        (["serve"], {"TIERGATE_KV_CACHE_BYTES": "9" * 21}, "kv_cache_bytes must be at most"),
        (["serve"], {"TIERGATE_HOST": "999.1.1.1"}, "cannot listen on 999.1.1.1"),
        *(
            (
                ["worker", "--redis-url", "redis://127.0.0.1:1/0", "--drain-timeout-s", value],
                {},
                "a drain timeout must be a finite number of seconds",
            )
            for value in ("-1", "nan", "inf")
        ),
        (
            ["worker", "--redis-url", "redis://127.0.0.1:1/0", "--lease-ms", "9" * 20],
            {},
            "a lease must be at most",
        ),
        (
            ["usage", "rebuild-rollup", "--start", "0001-01-01", "--end", "9999-12-31T23:59:59"],
            {},
            "--end must be at most",
        ),
        (
            ["usage", "rebuild-rollup", "--start", "2025-06-01", "--end", "2025-06-02"],
            {"TIERGATE_DATABASE_URL": "postgresql+asyncpg://u@127.0.0.1:1/x"},
            "cannot reach the database",
        ),
        (
            ["usage", "rebuild-rollup", "--start", "2025-06-01", "--end", "2025-06-02"],
            {},
            "no database at",
        ),
    ],
    ids=[
        "database",
        "database-missing",
        "redis",
        "model",
        "worker-redis",
        "telemetry",
        "kv-cache",
        "kv-cache-overflow",
        "host",
        "drain-negative",
        "drain-nan",
        "drain-inf",
        "lease-huge",
        "rollup-range",
        "rollup-database",
        "rollup-missing",
    ],
)
def test_what_would_fail_at_start_up_is_one_message(
    tmp_path: Path, argv: list[str], env: dict[str, str], message: str
) -> None:
    """Checked before the server starts: exit status 2 and one line, not a traceback."""
    ran = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *argv, "--data-dir", str(tmp_path)]
        if argv[0] != "worker"
        else [sys.executable, "-m", "gateway.cli", *argv],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "TIERGATE_DEVICE": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 2, ran.stderr[-2000:]
    assert message in ran.stderr
    assert "Traceback" not in ran.stderr
    # One line, after argparse's usage where the flag itself is refused (no SQLAlchemy
    # "Background on this error" line after it).
    lines = ran.stderr.strip().splitlines()
    assert message in lines[-1], ran.stderr
    assert len(lines) == 1 or lines[0].startswith("usage:"), ran.stderr


def test_output_piped_to_a_reader_that_leaves_ends_quietly() -> None:
    # `tiergate ... | head`: the reader closes the pipe before the output is written.
    command = [sys.executable, "-m", "gateway.cli", "simulate", "presets", "h200-llama-3.1-8b"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()
        stderr = proc.stderr.read()
    assert proc.returncode == 141  # as the shell reports a SIGPIPE
    assert stderr == b""  # no traceback, no "error:"


def test_demo_banner_prints_only_a_generated_admin_token(tmp_path: Path) -> None:
    from gateway.cli import _demo_banner

    settings = Settings(data_dir=tmp_path, admin_token="operator-chosen-secret-123")
    chosen = _demo_banner(settings, [], generated_token=False)
    assert "operator-chosen-secret-123" not in chosen
    assert "TIERGATE_ADMIN_TOKEN (not printed)" in chosen
    generated = _demo_banner(settings, [], generated_token=True)
    assert "operator-chosen-secret-123" in generated


def test_a_worker_starts_and_drains_without_noise() -> None:
    """`tiergate worker` on a CPU: it reports to the queue, and on SIGTERM drains and exits
    0. Its output holds none of the lines that used to open and close every worker's log:
    alembic's set-up (the worker has no database) and Triton's nanobind leak report."""
    import signal
    import uuid

    import redis

    from scheduler.keys import KeySpace
    from tests.conftest import REDIS_URL

    prefix = f"{{cli-worker-{uuid.uuid4().hex[:8]}}}:"
    keys = KeySpace(prefix)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TIERGATE_", "TRITON_"))},
        "TIERGATE_REDIS_URL": REDIS_URL,
        "TIERGATE_REDIS_PREFIX": prefix,
        "TIERGATE_DEVICE": "cpu",
        "TIERGATE_KV_CACHE_BYTES": str(16 * 2**20),
    }
    store = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "worker", "--worker-id", "quiet"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not store.zscore(keys.workers, "quiet"):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the worker never reported"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        reap(proc)
        names = list(store.scan_iter(match=keys.pattern()))
        if names:
            store.delete(*names)
        store.close()
    assert proc.returncode == 0, output[-3000:]
    assert "is draining" in output
    for noise in ("alembic", "nanobind", "Traceback"):
        assert noise not in output, output[-3000:]


def test_a_second_sigint_ends_serve_at_once_without_tracebacks(tmp_path: Path) -> None:
    """The first ^C drains (an open stream keeps the server up); a second one ends the
    process at once with 130, as a worker's does, not with uvicorn's forced exit (a
    traceback per cancelled task, and 0)."""
    import signal
    import threading

    import httpx

    port = _free_port()
    proc, started = _start_demo(tmp_path, port)
    first_chunk = threading.Event()
    try:
        key = dict(re.findall(r"tier=(\w+)\s+(tg-[A-Za-z0-9_-]+)", started))["batch"]

        def stream() -> None:
            body = {
                "model": "tiny-random",
                "prompt": "Once",
                "max_tokens": 2000,  # seconds of tokens on this model
                "ignore_eos": True,
                "stream": True,
            }
            headers = {"authorization": f"Bearer {key}"}
            url = f"http://127.0.0.1:{port}/v1/completions"
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream("POST", url, json=body, headers=headers, timeout=60) as reply,
            ):
                for line in reply.iter_lines():
                    if line.startswith("data: {"):
                        first_chunk.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert first_chunk.wait(60), "no token streamed"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None, "the first ^C waits for the open stream"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=20)
    finally:
        reap(proc)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "second SIGINT while shutting down: exiting now" in output
    assert "Traceback" not in output, output[-3000:]


def test_more_sequences_than_the_default_token_budget_start(tmp_path: Path) -> None:
    """TIERGATE_MAX_NUM_SEQS above 1,024 was refused as max_num_batched_tokens < max_num_seqs,
    a setting no variable or flag names."""
    from gateway.cli import _load_engine
    from gateway.engine_setup import engine_config

    many = Settings(data_dir=tmp_path, device="cpu", max_num_seqs=2000)
    config = engine_config(many)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (2000, 2000)
    engine = _load_engine(many)
    engine.shutdown()
    # Within the default budget, the budget stays the default.
    few = engine_config(Settings(data_dir=tmp_path, device="cpu", max_num_seqs=8))
    assert (few.max_num_seqs, few.max_num_batched_tokens) == (8, 1024)
