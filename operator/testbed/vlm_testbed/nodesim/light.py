"""Pods that need no process (LightPod): Running and Ready at once, vLLM's HTTP surface answered
from one event loop for all of them (LightEngines)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from .logserver import format_log_line
from .state import Instance, resolve_env, rfc3339

if TYPE_CHECKING:
    from .simulator import NodeSimulator


class LightEngines:
    """vLLM's HTTP surface for light pods, all on one asyncio loop (a thread of the simulator):
    /health, /ping, /metrics (progress counters that move with each completion), /v1/models,
    /v1/completions and /v1/chat/completions (answered at once), POST /sim/fault
    {"fault": "engine_dead"} (vLLM's engine-death lines in the log, /health 503 after) and
    POST /sim/log {"lines": [...]}. Thousands of pods cost one thread, not thousands of
    processes."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.servers: dict[str, Any] = {}
        threading.Thread(target=self.loop.run_forever, daemon=True, name="light-engines").start()

    def add(self, container: LightContainer, ip: str, port: int) -> None:
        import asyncio

        async def start():
            return await asyncio.start_server(
                lambda r, w: self._serve(container, r, w), ip, port, backlog=64)

        self.servers[ip] = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def remove(self, ip: str) -> None:
        server = self.servers.pop(ip, None)
        if server is not None:
            self.loop.call_soon_threadsafe(server.close)

    async def _serve(self, container: LightContainer, reader, writer) -> None:
        try:
            method, path, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip())
            body = await reader.readexactly(length) if length else b""
            status, ctype, data = container.answer(method, path.split("?")[0], body)
            writer.write(f"HTTP/1.1 {status} {'OK' if status < 400 else 'Error'}\r\n"
                         f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                         "Connection: close\r\n\r\n".encode() + data)
            await writer.drain()
        except Exception:  # a client that went away
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        for ip in list(self.servers):
            self.remove(ip)
        self.loop.call_soon_threadsafe(self.loop.stop)


class LightContainer:
    """One container of a light pod: always running, its log a file with (for vLLM) the
    plugin's startup line, and for vLLM images an engine on LightEngines."""

    def __init__(self, pod: LightPod, spec: dict) -> None:
        from vlm_testbed import vllmsim

        self.pod, self.spec, self.name = pod, spec, spec["name"]
        directory = pod.sim.work_dir / "light" / pod.uid
        directory.mkdir(parents=True, exist_ok=True)
        self.instances = [Instance(0, directory / f"{self.name}.log",
                                   f"sim://{uuid.uuid4().hex}", time.time_ns(),
                                   appended=threading.Condition())]
        self.vllm = "vllm" in spec.get("image", "")
        self.dead = False
        self.counters = dict.fromkeys(("vllm:request_success_total", "vllm:prompt_tokens_total",
                                       "vllm:generation_tokens_total"), 0.0)
        tokens = list(spec.get("command") or []) + list(spec.get("args") or [])
        rest = tokens[tokens.index("serve") + 1:] if "serve" in tokens else []
        self.model = vllmsim.parse_serve_args(rest).model_name if self.vllm else ""
        self.real_rest = vllmsim.real_families(frozenset((*vllmsim.GAUGES, *self.counters)),
                                               self.model)
        self.version = "0.32.0"
        env = resolve_env(pod.pod, spec, pod.ip, lambda kind, name, key: None)
        self.prefix = env.get("VLLM_LOGGING_PREFIX", "")
        lines = [vllmsim.plugin_line(self.version, proc, 1, env) for proc in
                 ("APIServer", vllmsim.engine_proc_name(self.version))] if self.vllm else []
        self.append([line for line in lines if line])

    def append(self, lines: list[str]) -> None:
        inst = self.instances[0]
        with inst.appended, open(inst.log_path, "a", encoding="utf-8") as log:
            for line in lines:
                log.write(format_log_line(time.time_ns(), "stdout", line))
            inst.lines += len(lines)
            inst.appended.notify_all()

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        import json

        from vlm_testbed import vllmsim

        if method == "GET" and path in ("/health", "/ping"):
            return (503 if self.dead else 200), "text/plain", b""
        if method == "GET" and path == "/metrics":
            text = vllmsim.render_metrics(
                f'engine="0",model_name="{self.model}"', dict.fromkeys(vllmsim.GAUGES, 0.0),
                dict(self.counters), {}, self.real_rest)
            return 200, "text/plain; version=0.0.4", text.encode()
        if method == "GET" and path == "/v1/models":
            return 200, "application/json", json.dumps(
                {"object": "list", "data": [{"id": self.model, "object": "model"}]}).encode()
        request = json.loads(body or b"{}") if method == "POST" else {}
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            if self.dead:
                return 500, "application/json", b'{"error": {"type": "EngineDeadError"}}'
            self.counters["vllm:request_success_total"] += 1
            self.counters["vllm:prompt_tokens_total"] += 1
            self.counters["vllm:generation_tokens_total"] += int(request.get("max_tokens") or 1)
            return 200, "application/json", json.dumps(
                {"object": "text_completion", "model": self.model,
                 "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}).encode()
        if method == "POST" and path == "/sim/fault" and request.get("fault") == "engine_dead":
            self.dead = True
            self.append(vllmsim.engine_dead_lines(self.version, 1, prefix=self.prefix))
            return 200, "application/json", b'{"applied": "engine_dead"}'
        if method == "POST" and path == "/sim/log":
            self.append([str(line) for line in request.get("lines", [])])
            return 200, "application/json", b"{}"
        return 404, "application/json", b'{"detail": "Not Found"}'

    def status(self) -> dict:
        inst = self.instances[0]
        return {"name": self.name, "image": self.spec.get("image", ""),
                "imageID": f"sim://{self.spec.get('image', '')}", "ready": True,
                "restartCount": 0, "started": True, "containerID": inst.container_id,
                "state": {"running": {"startedAt": rfc3339(inst.started_ns)}}, "lastState": {}}


class LightPod:
    """A pod that needs no process (annotation vlm-testbed/process=none, or the simulator's
    `light` predicate): Running and Ready at once, its status written once from a shared pool,
    no probes, no restarts. The apiserver objects are what controllers see, so a cluster of
    thousands of pods fits on one machine; vLLM containers answer from LightEngines."""

    def __init__(self, sim: NodeSimulator, pod: dict, ip: str) -> None:
        self.sim, self.pod, self.ip = sim, pod, ip
        self.meta, self.spec, self.uid = pod["metadata"], pod["spec"], pod["metadata"]["uid"]
        self.key = f"{self.meta['namespace']}/{self.meta['name']}"
        self.main = [LightContainer(self, c) for c in self.spec.get("containers") or []]
        self.engines = [c for c in self.main if c.vllm]
        for container in self.engines[:1]:
            port = next((p["containerPort"] for p in container.spec.get("ports") or []), 8000)
            sim.light_engines().add(container, ip, int(port))

    def container(self, name: str) -> LightContainer | None:
        return next((c for c in self.main if c.name == name), None)

    def status(self) -> dict:
        now = rfc3339()
        conditions = [{"type": t, "status": "True", "lastProbeTime": None,
                       "lastTransitionTime": now}
                      for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")]
        return {"phase": "Running", "hostIP": "127.0.0.1", "podIP": self.ip,
                "podIPs": [{"ip": self.ip}], "startTime": now, "conditions": conditions,
                "containerStatuses": [c.status() for c in self.main]}

    def stop(self) -> None:
        if self.engines:
            self.sim.light_engines().remove(self.ip)
