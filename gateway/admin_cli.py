"""`tiergate admin ...`: manage tiers, tenants and keys through the admin HTTP API.

    tiergate admin tiers list|get|create|update|delete
    tiergate admin tenants list|get|create|update|delete
    tiergate admin keys create|list|revoke

The server is `--url` (TIERGATE_URL, default http://127.0.0.1:8000) and the token
`--admin-token` (TIERGATE_ADMIN_TOKEN). Output is the API's JSON; an API error goes to
stderr with exit status 1; bad usage, an unreachable server or one with no admin API
(its admin API off, or --url not a tiergate server's root) exits with 2. A limit flag
set to `none` clears it: a tier's limit is then unlimited, a tenant's the tier's.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from gateway.cli_output import print_json, print_subcommand_help

DEFAULT_URL = "http://127.0.0.1:8000"
API_PREFIX = "/admin/v1"


def integer(raw: str) -> int:
    """An integer flag value (argparse names this function in its error: keep it plain)."""
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not an integer") from None


def number(raw: str) -> float:
    """A finite number: JSON has no NaN or infinity to send."""
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a finite number")
    return value


# Past this a timeout or poll interval overflows the clocks it is handed to (socket
# timeouts, time.sleep) with a traceback; a million seconds is over eleven days.
MAX_SECONDS = 1_000_000


def positive_seconds(raw: str) -> float:
    value = number(raw)
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not a number of seconds above 0 and at most {MAX_SECONDS:,}"
        )
    return value


def _int_or_none(raw: str) -> int | None:
    return None if raw.lower() in ("none", "null") else integer(raw)


def _float_or_none(raw: str) -> float | None:
    return None if raw.lower() in ("none", "null") else number(raw)


# argparse says "invalid <type name> value"; these read as what the flag takes.
_int_or_none.__name__ = "integer (or none)"
_float_or_none.__name__ = "number (or none)"


# (flag, type, help) of every tier field an admin may set; `dest` is the JSON field name.
# A tier's limits bind each of its tenants that sets none of its own.
_TIER_FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
    ("--rank", integer, "order of service, 0 first (0 to 1000)"),
    (
        "--ttft-slo-ms",
        _float_or_none,
        "time-to-first-token SLO; a request that cannot meet it is refused (none: no SLO)",
    ),
    ("--tpot-slo-ms", _float_or_none, "time-per-output-token SLO (none: no SLO)"),
    (
        "--max-queue-ms",
        _float_or_none,
        "longest a request waits queued before it is dropped (none: no limit)",
    ),
    (
        "--max-queued-jobs",
        _int_or_none,
        "jobs of all the tier's tenants queued at once; more are refused (none: no cap)",
    ),
    (
        "--completion-window-s",
        _int_or_none,
        "deadline of the tier's batches, when shorter than 24h (none: 24h)",
    ),
    ("--min-share", number, "share of capacity below which it is served first (0 to <1)"),
    ("--rpm", _int_or_none, "requests per minute per tenant (none: unlimited)"),
    ("--tpm", _int_or_none, "tokens per minute per tenant (none: unlimited)"),
    ("--max-concurrency", _int_or_none, "requests per tenant at once (none: unlimited)"),
    ("--price-input-per-mtok", number, "price of a million input tokens"),
    ("--price-output-per-mtok", number, "price of a million output tokens"),
]
_TENANT_LIMIT_FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
    ("--weight", number, "share against the tier's other tenants (0.001 to 1000; new: 1)"),
    ("--rpm", _int_or_none, "requests per minute (none: the tier's limit)"),
    ("--tpm", _int_or_none, "tokens per minute (none: the tier's limit)"),
    ("--max-concurrency", _int_or_none, "requests at once (none: the tier's limit)"),
]
_BODY_FIELDS = {
    "name",
    "tier",
    "status",
    "preemptible",
    "expires_at",
    "expires_in_s",
    *(flag[2:].replace("-", "_") for flag, _, _ in _TIER_FLAGS + _TENANT_LIMIT_FLAGS),
}


# In every --help: argparse rewraps it, so it is one paragraph.
EXIT_STATUS_EPILOG = (
    "exit status: 0 done, 1 the API refused the request (its error on stderr), 2 bad "
    "usage, or no admin API at --url (unreachable, not a tiergate server, or its admin "
    "API off)"
)


def _connection_flags() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("TIERGATE_URL", DEFAULT_URL),
        help="tiergate server (TIERGATE_URL, default %(default)s)",
    )
    common.add_argument(
        "--admin-token",
        default=os.environ.get("TIERGATE_ADMIN_TOKEN"),
        help="admin bearer token (TIERGATE_ADMIN_TOKEN)",
    )
    common.add_argument("--timeout-s", type=positive_seconds, default=30.0, help="HTTP timeout")
    return common


def _add_fields(parser: argparse.ArgumentParser, flags, *, required: tuple[str, ...] = ()) -> None:
    for flag, kind, help_ in flags:
        # SUPPRESS: a flag not given is not sent, so PATCH changes only what was asked.
        parser.add_argument(
            flag, type=kind, default=argparse.SUPPRESS, required=flag in required, help=help_
        )


def add_admin_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `admin` and its commands on the `tiergate` parser's subparsers.

    Each leaf sets `func(args) -> int` (the exit status).
    """
    common = _connection_flags()
    admin = subparsers.add_parser(
        "admin",
        help="manage tiers, tenants and API keys over the admin API",
        epilog=EXIT_STATUS_EPILOG,
    )
    groups = admin.add_subparsers(title="objects", metavar="OBJECT")
    admin.set_defaults(func=lambda args: print_subcommand_help(admin))

    def leaf(group, name: str, help_: str, build: Callable[[argparse.Namespace], tuple]):
        parser = group.add_parser(name, help=help_, parents=[common], epilog=EXIT_STATUS_EPILOG)
        parser.set_defaults(func=lambda args: _call_built(args, build))
        return parser

    tiers = _group(groups, "tiers", "service tiers")
    leaf(tiers, "list", "list tiers", lambda a: ("GET", "/tiers", None))
    leaf(tiers, "get", "show a tier", lambda a: ("GET", f"/tiers/{_q(a.tier_name)}", None))
    create = leaf(tiers, "create", "add a tier", lambda a: ("POST", "/tiers", _body(a)))
    update = leaf(
        tiers, "update", "change a tier", lambda a: ("PATCH", f"/tiers/{_q(a.name)}", _body(a))
    )
    leaf(
        tiers, "delete", "delete an unused tier", lambda a: ("DELETE", f"/tiers/{_q(a.tier_name)}")
    )
    for parser in (create, update):
        parser.add_argument("name", help="tier name, e.g. gold")
        # The API refuses a new tier without a rank; an update changes only what it names.
        _add_fields(parser, _TIER_FLAGS, required=("--rank",) if parser is create else ())
        parser.add_argument(
            "--preemptible",
            action=argparse.BooleanOptionalAction,
            default=argparse.SUPPRESS,
            help="whether better-ranked requests may preempt its running work (new: no)",
        )
    for parser in tiers.choices.values():
        if parser.prog.split()[-1] in ("get", "delete"):
            parser.add_argument("tier_name", metavar="name")

    tenants = _group(groups, "tenants", "tenants")
    listing = leaf(tenants, "list", "list tenants", lambda a: ("GET", _tenant_page(a), None))
    listing.add_argument("--limit", type=integer, default=100)
    listing.add_argument("--after", help="last tenant id of the previous page")
    get = leaf(tenants, "get", "show a tenant", lambda a: ("GET", f"/tenants/{_q(a.id)}", None))
    create = leaf(tenants, "create", "add a tenant", lambda a: ("POST", "/tenants", _body(a)))
    create.add_argument("name")
    create.add_argument("--tier", required=True)
    update = leaf(
        tenants, "update", "change a tenant", lambda a: ("PATCH", f"/tenants/{_q(a.id)}", _body(a))
    )
    update.add_argument("id", help="tenant id (ten_...)")
    update.add_argument("--name", default=argparse.SUPPRESS)
    update.add_argument("--tier", default=argparse.SUPPRESS)
    update.add_argument("--status", choices=["active", "suspended"], default=argparse.SUPPRESS)
    delete = leaf(
        tenants,
        "delete",
        "delete a tenant and its keys",
        lambda a: ("DELETE", f"/tenants/{_q(a.id)}"),
    )
    for parser in (get, delete):
        parser.add_argument("id", help="tenant id (ten_...)")
    for parser in (create, update):
        _add_fields(parser, _TENANT_LIMIT_FLAGS)

    keys = _group(groups, "keys", "API keys")
    create = leaf(
        keys,
        "create",
        "mint a key (the secret is printed once)",
        lambda a: ("POST", f"/tenants/{_q(a.tenant_id)}/keys", _body(a)),
    )
    create.add_argument("tenant_id", help="tenant id (ten_...)")
    create.add_argument("--name", default=argparse.SUPPRESS)
    create.add_argument("--expires-at", default=argparse.SUPPRESS, help="ISO 8601, with zone")
    create.add_argument("--expires-in-s", type=integer, default=argparse.SUPPRESS)
    listing = leaf(
        keys,
        "list",
        "list a tenant's keys (no secrets)",
        lambda a: ("GET", f"/tenants/{_q(a.tenant_id)}/keys", None),
    )
    listing.add_argument("tenant_id", help="tenant id (ten_...)")
    revoke = leaf(keys, "revoke", "revoke a key", lambda a: ("DELETE", f"/keys/{_q(a.key_id)}"))
    revoke.add_argument("key_id", help="key id (key_...)")
    return admin


def _group(groups, name: str, help_: str):
    parser = groups.add_parser(name, help=help_, epilog=EXIT_STATUS_EPILOG)
    parser.set_defaults(func=lambda args: print_subcommand_help(parser))
    return parser.add_subparsers(metavar="ACTION")


class BadIdError(ValueError):
    """An id or name that cannot be sent as one segment of a URL path; the message says
    why, worded to follow "the id" or "an id or name"."""


def path_segment(value: str) -> str:
    """`value` quoted as one URL path segment, or BadIdError when no quoting keeps it
    one and the request would address another path than the one asked for."""
    if not value:  # would address the collection
        raise BadIdError("may not be empty")
    if value in (".", ".."):
        # Dot segments: quote() leaves them as they are (they are unreserved) and the
        # client resolves them away before sending (`tiers get ..` asked for /admin/v1).
        raise BadIdError(f"may not be {value!r}: the request would go to another path")
    if "/" in value:
        # quote(safe="") sends %2F, but the server decodes the path before routing.
        raise BadIdError(f"may not contain '/' ({value!r}): the request would go to another path")
    if not is_utf8(value):
        raise BadIdError(f"is not UTF-8 text ({value!r})")
    return quote(value, safe="")


_q = path_segment  # the short name the route table above reads best with


def _tenant(args: argparse.Namespace) -> str:
    return f"/tenants/{_q(args.id)}"


def _tenant_page(args: argparse.Namespace) -> str:
    query = f"/tenants?limit={args.limit}"
    if args.after is None:
        return query
    if not args.after:
        raise BadIdError("may not be empty")
    # A query value, not a path segment: dots and slashes are plain data here.
    return f"{query}&after={quote(args.after, safe='')}"


def _body(args: argparse.Namespace) -> dict[str, Any]:
    return {name: value for name, value in vars(args).items() if name in _BODY_FIELDS}


def _call_built(args: argparse.Namespace, build: Callable[[argparse.Namespace], tuple]) -> int:
    try:
        request = build(args)
    except BadIdError as exc:
        # Refused before anything is sent.
        print(f"tiergate admin: an id or name {exc}", file=sys.stderr)
        return 2
    if not all(is_utf8(v) for v in _body(args).values() if isinstance(v, str)):
        # Bytes argv could not decode: no JSON body can carry them.
        print("tiergate admin: an argument is not UTF-8 text", file=sys.stderr)
        return 2
    return _call(args, *request)


def is_utf8(text: str) -> bool:
    """Whether `text` can be sent: argv bytes that are not UTF-8 arrive as lone
    surrogates, which httpx and quote() meet with a traceback."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_token_text(value: str) -> bool:
    """Whether a secret can go in an Authorization header: printable ASCII, no space
    (a token pasted with its newline failed as "cannot reach" the server)."""
    return value.isascii() and value.isprintable() and not any(c.isspace() for c in value)


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> int:
    if not args.admin_token:
        print("tiergate admin: set --admin-token or TIERGATE_ADMIN_TOKEN", file=sys.stderr)
        return 2
    if not is_token_text(args.admin_token):
        print(
            "tiergate admin: the admin token is printable ASCII with no spaces; this one is not",
            file=sys.stderr,
        )
        return 2
    url = args.url.rstrip("/") + API_PREFIX + path
    try:
        with httpx.Client(timeout=args.timeout_s) as client:
            response = client.request(
                method,
                url,
                json=body,
                headers={"authorization": f"Bearer {args.admin_token}"},
            )
    except httpx.InvalidURL as exc:  # not an HTTPError: raised before any connection
        print(f"tiergate admin: --url {args.url!r} is not a valid URL: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"tiergate admin: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    try:
        payload = response.json()
    except ValueError:
        payload = {"status": response.status_code, "body": response.text}
    if not response.is_success:
        reason = no_admin_api(args.url, response.status_code, payload)
        if reason is not None:
            print(f"tiergate admin: {reason}", file=sys.stderr)
            return 2
    out = sys.stdout if response.is_success else sys.stderr
    print_json(payload, out)
    return 0 if response.is_success else 1


def no_admin_api(url: str, status: int, payload: Any) -> str | None:
    """Why there is no admin API at `url`, when a refusal says so; None for a refusal
    of the admin API itself (an unknown tier, a bad field), which is printed as it is."""
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict) or "type" not in error:
        return (
            f"{url} answered {status} without a tiergate error: it is not a tiergate "
            "server (or a proxy in front of one answered)"
        )
    if error.get("code") == "admin_api_disabled":
        return (
            f"the admin API is off on the server at {url}: it was started without "
            "TIERGATE_ADMIN_TOKEN (set it, or serve --admin-token, to turn the API on)"
        )
    if status == 404 and error.get("code") == "unknown_url":
        # The CLI asks only for paths the admin API has.
        path = urlsplit(url).path
        if path.strip("/"):
            return f"--url {url} is not the server's root: leave out {path!r}"
        return (
            f"the server at {url} has no {API_PREFIX}: a tiergate older than this command "
            "answers so when its admin API is off (no TIERGATE_ADMIN_TOKEN)"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway.admin_cli ...` (the same commands as `tiergate admin ...`)."""
    parser = argparse.ArgumentParser(prog="tiergate")
    add_admin_parser(parser.add_subparsers())
    args = parser.parse_args(["admin", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
