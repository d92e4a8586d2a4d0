"""`tiergate admin ...` against a live admin API (uvicorn on a free port, real database)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.admin import AdminDeps, admin_routes
from gateway.admin_cli import main
from gateway.auth import KeyAuthenticator
from gateway.db.session import create_db_engine, create_sessionmaker
from gateway.tiers import TierCatalog
from tests.gateway.conftest import ServerThread, build_test_engine

TOKEN = "cli-admin-token"


def _admin_app(database_url: str) -> Starlette:
    routes: list = []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = create_db_engine(database_url)
        sessions = create_sessionmaker(engine)
        tiers = TierCatalog(sessions)
        deps = AdminDeps(sessions, TOKEN, tiers, KeyAuthenticator(sessions, tiers))
        routes.append(Mount("/admin/v1", routes=admin_routes(deps)))
        app.router.routes.extend(routes)
        yield
        await engine.dispose()

    return Starlette(lifespan=lifespan)


@pytest.fixture
def server_url(migrated_database_url: str) -> Iterator[str]:
    config = uvicorn.Config(
        _admin_app(migrated_database_url), host="127.0.0.1", port=0, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "admin server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def admin_off_url(tmp_path: Path) -> Iterator[str]:
    """The real gateway started without TIERGATE_ADMIN_TOKEN: its admin API is off."""
    from gateway.app import build_app
    from gateway.settings import Settings

    settings = Settings(data_dir=tmp_path, admin_token=None, model="tiny-random", device="cpu")
    thread = ServerThread(build_app(settings, engine=build_test_engine()))
    thread.start()
    try:
        yield f"http://127.0.0.1:{thread.port}"
    finally:
        thread.stop()


def _run(capsys, url: str, *argv: str, token: str = TOKEN) -> tuple[int, dict | None, str]:
    code = main([*argv[:2], "--url", url, "--admin-token", token, *argv[2:]])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_admin_cli_round_trip(server_url: str, capsys) -> None:
    code, tiers, _ = _run(capsys, server_url, "tiers", "list")
    assert code == 0
    assert [t["name"] for t in tiers["data"]] == ["priority", "interactive", "batch"]

    code, gold, _ = _run(
        capsys, server_url, "tiers", "create", "gold", "--rank", "0", "--ttft-slo-ms", "300",
        "--preemptible", "--rpm", "50", "--max-queued-jobs", "20",
    )  # fmt: skip
    assert code == 0
    assert (gold["ttft_slo_ms"], gold["preemptible"], gold["rpm"]) == (300.0, True, 50)
    assert gold["max_queued_jobs"] == 20
    code, gold, _ = _run(capsys, server_url, "tiers", "update", "gold", "--rpm", "none")
    assert (code, gold["rpm"], gold["ttft_slo_ms"]) == (0, None, 300.0)  # only what was asked
    assert gold["max_queued_jobs"] == 20
    code, gold, _ = _run(capsys, server_url, "tiers", "update", "gold", "--max-queued-jobs", "none")
    assert (code, gold["max_queued_jobs"]) == (0, None)

    code, tenant, _ = _run(capsys, server_url, "tenants", "create", "acme", "--tier", "gold")
    assert code == 0
    code, tenant, _ = _run(
        capsys, server_url, "tenants", "update", tenant["id"], "--status", "suspended",
        "--weight", "2",
    )  # fmt: skip
    assert (code, tenant["status"], tenant["weight"]) == (0, "suspended", 2.0)
    code, page, err = _run(capsys, server_url, "tenants", "list", "--limit", "5")
    assert code == 0, err
    assert [t["id"] for t in page["data"]] == [tenant["id"]]

    code, key, _ = _run(capsys, server_url, "keys", "create", tenant["id"], "--name", "ci")
    assert code == 0
    assert key["secret"].startswith("tg-")
    code, keys, _ = _run(capsys, server_url, "keys", "list", tenant["id"])
    assert [k["id"] for k in keys["data"]] == [key["id"]]
    assert "secret" not in keys["data"][0]
    code, revoked, _ = _run(capsys, server_url, "keys", "revoke", key["id"])
    assert revoked["revoked_at"] is not None

    # API errors: JSON on stderr, exit status 1.
    code, out, err = _run(capsys, server_url, "tiers", "delete", "gold")
    assert (code, out) == (1, None)
    assert json.loads(err)["error"]["code"] == "tier_in_use"
    assert _run(capsys, server_url, "tenants", "delete", tenant["id"])[0] == 0
    assert _run(capsys, server_url, "tiers", "delete", "gold")[0] == 0
    code, _, err = _run(capsys, server_url, "tenants", "get", "ten missing?x")
    assert code == 1
    assert json.loads(err)["error"]["type"] == "not_found_error"


def test_admin_cli_refusals(server_url: str, capsys) -> None:
    code, _, err = _run(capsys, server_url, "tiers", "list", token="wrong")
    assert code == 1
    assert json.loads(err)["error"]["type"] == "authentication_error"
    code, _, err = _run(capsys, "http://127.0.0.1:9", "tiers", "list")  # nothing listens
    assert code == 2
    assert "cannot reach" in err
    # No tiergate error at all (Starlette's plain-text 404): not a tiergate server.
    code, _, err = _run(capsys, server_url + "/elsewhere", "tiers", "list")
    assert code == 2
    assert "not a tiergate server" in err
    code, _, err = _run(capsys, server_url, "tiers", "list", token="")
    assert code == 2
    assert "TIERGATE_ADMIN_TOKEN" in err


@pytest.mark.parametrize(
    "argv",
    [
        ("tiers", "create", "x", "--rank", "1", "--ttft-slo-ms", "nan"),
        ("tiers", "create", "x", "--rank", "1", "--price-input-per-mtok", "inf"),
        ("tenants", "create", "x", "--tier", "batch", "--weight", "nan"),
        ("tenants", "create", "x", "--tier", "batch", "--rpm", "abc"),
        ("tiers", "list", "--timeout-s", "-1"),
    ],
)
def test_bad_flag_values_are_usage_errors(server_url: str, capsys, argv) -> None:
    """Refused by the CLI with argparse's exit status 2 and a message naming the value,
    not a traceback after the request was built."""
    with pytest.raises(SystemExit) as exited:
        _run(capsys, server_url, *argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "_int_or_none" not in err


def test_empty_ids_and_foreign_tokens_are_refused_plainly(server_url: str, capsys) -> None:
    code, _, err = _run(capsys, server_url, "tiers", "get", "")
    assert code == 2
    assert "may not be empty" in err
    # Bytes argv could not decode (a traceback from httpx or quote() before).
    for argv in (("tenants", "create", "\udcff", "--tier", "batch"), ("tiers", "get", "\udcff")):
        code, _, err = _run(capsys, server_url, *argv)
        assert code == 2
        assert "not UTF-8 text" in err
    for token in ("tøken", "token\n", "to ken"):  # a pasted newline: "cannot reach" before
        code, _, err = _run(capsys, server_url, "tiers", "list", token=token)
        assert code == 2
        assert "printable ASCII with no spaces" in err


def test_admin_cli_prints_names_in_their_own_letters(server_url: str, capsys) -> None:
    code = main(
        [
            "tenants",
            "create",
            "Zoë 株式会社",
            "--tier",
            "batch",
            "--url",
            server_url,
            "--admin-token",
            TOKEN,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "Zoë 株式会社" in out
    assert json.loads(out)["name"] == "Zoë 株式会社"


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:abc"])
def test_a_malformed_url_is_one_line_and_exit_2(url: str, capsys) -> None:
    # httpx.InvalidURL is not an httpx.HTTPError: it escaped as a traceback.
    from gateway.batch_cli import main as batch_main

    assert main(["tiers", "list", "--url", url, "--admin-token", TOKEN]) == 2
    assert "not a valid URL" in capsys.readouterr().err
    assert batch_main(["status", "batch_x", "--url", url, "--api-key", "tg-x"]) == 2
    assert "not a valid URL" in capsys.readouterr().err


def test_a_server_with_its_admin_api_off_is_told_from_a_wrong_url(
    admin_off_url: str, capsys
) -> None:
    """Both answered 404 `Unknown URL /admin/v1/tiers`, printed with exit status 1: it
    read the same whether the admin API was off or --url was not the server's root."""
    code, out, err = _run(capsys, admin_off_url, "tiers", "list")
    assert (code, out) == (2, None)
    assert "admin API is off" in err
    assert "TIERGATE_ADMIN_TOKEN" in err
    # Still a 404, as for any unknown URL: only its code says more.
    reply = httpx.get(f"{admin_off_url}/admin/v1/tiers")
    assert (reply.status_code, reply.json()["error"]["code"]) == (404, "admin_api_disabled")
    # A path in --url: the gateway does not know /v1/admin/v1/tiers.
    code, _, err = _run(capsys, admin_off_url + "/v1", "tiers", "list")
    assert code == 2
    assert "not the server's root" in err


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_says_what_the_api_requires_and_what_none_does(capsys) -> None:
    """--rank showed as optional though the API refuses a tier without it; the limit
    flags had no help, and `none` was told only in the module's docstring."""
    with pytest.raises(SystemExit) as exited:
        main(["tiers", "create", "gold", "--admin-token", TOKEN])
    assert exited.value.code == 2
    assert "required: --rank" in capsys.readouterr().err
    assert "[--rank RANK]" in _help(capsys, "tiers", "update")  # a PATCH changes what it names

    tier = " ".join(_help(capsys, "tiers", "create").split())  # argparse wraps the lines
    for flag in ("--ttft-slo-ms", "--rpm", "--tpm", "--max-concurrency", "--max-queued-jobs"):
        assert f"{flag} " in tier
    assert tier.count("none: ") >= 8  # every nullable field says what none does
    assert "none: unlimited" in tier
    tenant = " ".join(_help(capsys, "tenants", "update").split())
    assert "none: the tier's limit" in tenant


@pytest.mark.parametrize("argv", [(), ("tiers",), ("tiers", "create"), ("keys", "revoke")])
def test_help_gives_the_exit_statuses(capsys, argv) -> None:
    text = " ".join(_help(capsys, *argv).split())
    assert "exit status: 0 done, 1 the API refused the request" in text
    assert "2 bad usage, or no admin API at --url" in text


def _refusal(capsys, url: str, *argv: str) -> str:
    code, out, err = _run(capsys, url, *argv)
    assert (code, out) == (1, None), err
    return json.loads(err)["error"]["message"]


def test_refusals_print_bounds_as_written_and_say_what_a_name_may_be(
    server_url: str, capsys
) -> None:
    """Bounds came as `tpm must be <= 2.14748e+09`, and a bad name as `name has an invalid
    format`, which left the operator guessing what it accepts."""
    tier = ("tiers", "create", "t1", "--rank", "1")
    assert _refusal(capsys, server_url, *tier, "--tpm", "3000000000") == (
        "tpm must be <= 2147483647"
    )
    assert _refusal(capsys, server_url, *tier, "--price-input-per-mtok", "2e6") == (
        "price_input_per_mtok must be <= 1000000"
    )
    assert _refusal(capsys, server_url, *tier, "--min-share", "1") == "min_share must be < 1"
    assert _refusal(capsys, server_url, "tiers", "create", "Gold!", "--rank", "1") == (
        "name must be 1 to 32 lowercase letters, digits, '_' or '-', starting with a "
        "letter or digit"
    )
    assert _refusal(capsys, server_url, "tenants", "create", "a\tb", "--tier", "batch") == (
        "name may not contain control characters"
    )
