"""What the stand-in is started with: `vllm serve` flags (ServeArgs), the faults it knows, the
API key and the paths it guards."""

from __future__ import annotations

from dataclasses import dataclass, field

FAULTS = ("tokenizer_retry", "engine_dead", "hang", "stall", "load", "slow_metrics",
          "redirect", "huge_metrics", "drip_headers", "proc_flood", "giant_pid", "clear",
          "long_prefill", "long_step", "log_flood")
HOSTILE_PATHS = {"redirect": ("/metrics", "/v1/models", "/v1/completions"),
                 "drip_headers": ("/metrics", "/v1/models")}


def version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


VALUE_FLAGS = {"--port", "--host", "--served-model-name", "--renderer-num-workers",
               "--max-model-len", "--model", "--api-key"}
# vLLM's AuthenticationMiddleware (0.32: vllm/entrypoints/serve/middleware/authenticate.py):
# with a key set, paths under these need `Authorization: Bearer <key>`; /health, /metrics,
# /ping and /version do not. Anything else answers 401 {"error": "Unauthorized"}.
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


@dataclass
class ServeArgs:
    model: str = "facebook/opt-125m"
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: list[str] = field(default_factory=list)
    renderer_num_workers: int = 1
    max_model_len: int | None = None
    api_keys: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else self.model


def parse_serve_args(argv: list[str]) -> ServeArgs:
    """Parse the few `vllm serve` flags the simulator uses; keep the rest aside, like vLLM would
    accept them. An unknown `--flag value` pair is skipped as a pair."""
    out = ServeArgs()
    positional: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--"):
            name, eq, inline = tok.partition("=")
            if name == "--served-model-name":
                values = [inline] if eq else []
                while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    values.append(argv[i + 1])
                    i += 1
                out.served_model_name = values
            elif name in VALUE_FLAGS:
                if eq:
                    value = inline
                else:
                    value = argv[i + 1] if i + 1 < len(argv) else ""
                    i += 1
                if name == "--port":
                    out.port = int(value)
                elif name == "--host":
                    out.host = value
                elif name == "--renderer-num-workers":
                    out.renderer_num_workers = int(value)
                elif name == "--max-model-len":
                    out.max_model_len = int(value)
                elif name == "--api-key":  # may be given more than once, as in vLLM
                    out.api_keys.append(value)
                else:
                    positional.insert(0, value)
            else:
                out.ignored.append(tok)
                if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                    out.ignored.append(argv[i + 1])
                    i += 1
        else:
            positional.append(tok)
        i += 1
    if positional and positional[0] == "serve":
        positional.pop(0)
    if positional:
        out.model = positional[0]
    return out


def api_keys(args: ServeArgs, env: dict[str, str]) -> list[str]:
    """The keys vLLM enforces: --api-key (every one given) wins over VLLM_API_KEY."""
    return [key for key in (args.api_keys or [env.get("VLLM_API_KEY")]) if key]


def authorized(path: str, authorization: str | None, keys: list[str]) -> bool:
    """vLLM's AuthenticationMiddleware: guarded paths need `Bearer <one of the keys>`."""
    if not keys or not path.startswith(GUARDED_PREFIXES):
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and token in keys
