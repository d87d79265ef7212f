"""A firewall between the operator and one pod: the operator's connections to the pod's port
are dropped (its connects time out, as behind a default-deny NetworkPolicy), rejected with a
TCP reset (refused, as some CNIs do) or silenced (connected, then nothing arrives), while every
other process, the node simulator's probes included, still reaches it. As on a real cluster,
where the kubelet probes from the node and the operator's traffic crosses the pod network.

How: the test bed's operator processes run with their own group id (OPERATOR_GID;
OperatorProcess starts them through `setpriv --regid`). A mangle-table chain marks packets
sent by processes of that group (`-m owner --gid-owner`), and a filter-table chain on INPUT
drops or rejects marked packets to the pod's IP and port (pod IPs are loopback addresses here).
Each Firewall has its own chains, hooked in on enter and removed, with its rules, on exit.

Needs iptables (hack/install-deps.sh installs it) and root: without them `__enter__` raises,
so a test that needs the firewall fails, never skips.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

OPERATOR_GID = 46135  # a group no account uses: the test bed's operator processes run in it
MARK = "0x4a61"  # the mark on their packets (one for every Firewall: a later MARK rule for
# the same group would otherwise overwrite an earlier Firewall's mark)
PORT = 8000
_serial = itertools.count()


class FirewallError(RuntimeError):
    pass


class Firewall:
    def __init__(self, gid: int = OPERATOR_GID) -> None:
        self.gid = gid
        self.chain = f"VLMFW-{os.getpid()}-{next(_serial)}"
        self._hooked: list[list[str]] = []  # the hooks to delete on exit
        self._rules: dict[str, list[str]] = {}  # pod IP -> its filter rule

    def __enter__(self) -> Firewall:
        if shutil.which("iptables") is None:
            raise FirewallError("iptables is not installed (hack/install-deps.sh installs the "
                                "Debian package iptables): the test cannot cut the operator "
                                "off from a pod")
        try:
            for table in ("mangle", "filter"):
                self._run("-t", table, "-N", self.chain)
            self._run("-t", "mangle", "-A", self.chain, "-m", "owner", "--gid-owner",
                      str(self.gid), "-j", "MARK", "--set-mark", MARK)
            self._hook(["-t", "mangle", "OUTPUT", "-j", self.chain])
            self._hook(["-t", "filter", "INPUT", "-j", self.chain])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for hook in reversed(self._hooked):
            self._run("-t", hook[1], "-D", *hook[2:], check=False)
        self._hooked = []
        for table in ("mangle", "filter"):
            self._run("-t", table, "-F", self.chain, check=False)
            self._run("-t", table, "-X", self.chain, check=False)
        self._rules = {}

    def drop(self, ip: str, port: int = PORT) -> None:
        """The operator's packets to ip:port vanish: its connects time out."""
        self._set(ip, ["-p", "tcp", "--dport", str(port), "-j", "DROP"])

    def reject(self, ip: str, port: int = PORT) -> None:
        """The operator's connects to ip:port are answered with a reset: refused."""
        self._set(ip, ["-p", "tcp", "--dport", str(port), "-j", "REJECT",
                       "--reject-with", "tcp-reset"])

    def silence(self, ip: str, port: int = PORT) -> None:
        """The operator's connects to ip:port succeed (its SYN passes, the pod's SYN-ACK comes
        back) but nothing it sends after arrives: the pod seems to accept the connection and
        never answer, to the operator only."""
        self._set(ip, ["-p", "tcp", "--dport", str(port), "!", "--syn", "-j", "DROP"])

    def allow(self, ip: str) -> None:
        """Lift what drop or reject set for ip."""
        rule = self._rules.pop(ip, None)
        if rule is not None:
            self._run("-t", "filter", "-D", self.chain, *rule)

    def _set(self, ip: str, action: list[str]) -> None:
        self.allow(ip)
        rule = ["-m", "mark", "--mark", MARK, "-d", ip, *action]
        self._run("-t", "filter", "-A", self.chain, *rule)
        self._rules[ip] = rule

    def _hook(self, hook: list[str]) -> None:
        table, chain, *rest = hook[1], hook[2], *hook[3:]
        self._run("-t", table, "-I", chain, "1", *rest)
        self._hooked.append(hook)

    @staticmethod
    def _run(*args: str, check: bool = True) -> None:
        done = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True,
                              check=False)
        if check and done.returncode:
            raise FirewallError(f"iptables {' '.join(args)} failed ({done.returncode}): "
                                f"{done.stderr.strip()} (the firewall needs root)")
