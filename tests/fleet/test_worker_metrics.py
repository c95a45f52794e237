"""GET /metrics on a fleet Worker's status surface (issue 26 §3): a real Worker process against
the Worker-protocol stub, scraped over loopback, read by prometheus_client's parser and linted by
``promtool check metrics``."""

from __future__ import annotations

import http.client
import socket
import time

from prometheus_client.parser import text_string_to_metric_families

from qlagent.core.metrics import CONTENT_TYPE
from kit import TcpProxy, free_port, promtool_check, wait_until
from stubcp import now_us
from test_worker_runtime import Worker, _http, _wait_http, completion, cp  # noqa: F401 (cp: fixture)


def scrape(port: int) -> dict[str, float]:
    """sample name → value (every Worker family has one sample)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/metrics")
        r = c.getresponse()
        data = r.read()
        assert r.status == 200 and r.getheader("Content-Type") == CONTENT_TYPE, data
    finally:
        c.close()
    promtool_check(data.decode())
    return {s.name: s.value for f in text_string_to_metric_families(data.decode()) for s in f.samples}


def test_worker_metrics_are_present_and_move_with_a_run(tmp_path, cp):
    port = free_port()
    w = Worker(tmp_path, cp, cp.url,
               extra=f'\n[http]\nlisten = "127.0.0.1:{port}"\nmetrics = true\n')
    w.start()
    try:
        assert _wait_http(port, "/healthz")[0] == 200
        assert cp.wait(lambda: _http(port, "/api/v3/worker")[1]["heartbeatRttS"] is not None, 20), w.journal()
        idle = scrape(port)
        assert idle["qlagent_worker_slots"] == 2 and idle["qlagent_worker_free_slots"] == 2
        assert idle["qlagent_worker_session_open"] == 1 and idle["qlagent_worker_sessions_total"] == 1
        assert idle["qlagent_worker_reconnects_total"] == 0 and idle["qlagent_worker_self_fences_total"] == 0
        assert 0 < idle["qlagent_worker_heartbeat_rtt_seconds"] < 5
        assert idle["qlagent_worker_live_runs"] == idle["qlagent_worker_runs_spawned_total"] == 0
        assert idle["qlagent_worker_inbox_max_rows"] == 64 and idle["qlagent_worker_log_store_max_bytes"] > 0
        aid = cp.add_run(shell="/bin/sh", script="exec sleep 30")
        assert cp.wait(lambda: "running" in cp.acks_of(aid), 30)
        busy = scrape(port)
        assert busy["qlagent_worker_live_runs"] == 1 and busy["qlagent_worker_free_slots"] == 1
        assert busy["qlagent_worker_runs_spawned_total"] == 1 and busy["qlagent_worker_inbox_rows"] == 1
        assert busy["qlagent_worker_inbox_bytes"] > 0 and busy["qlagent_worker_log_store_bytes"] > 0
        assert busy["qlagent_worker_pulls_total"] > idle["qlagent_worker_pulls_total"]
        cp.cancel(aid)
        assert cp.wait(lambda: completion(cp, aid) is not None, 20)
        wait_until(lambda: scrape(port)["qlagent_worker_runs_completed_total"] == 1, 10, "one completed run counted")
        done = scrape(port)
        assert done["qlagent_worker_runs_completed_total"] == 1 and done["qlagent_worker_live_runs"] == 0
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


def test_worker_metrics_count_a_self_fence_and_the_reconnect_after_a_link_cut(tmp_path, cp):
    """A cut past the Worker's fencing instant and the Session's TTL (6 s at the stub): the
    Worker stops its run itself, and once the link is back opens a new Session — both counted
    on its status surface, which answers throughout (it is local). The stub offers the fenced
    Attempt again once its Lease ran out: the stop ends that run at once (drain_grace_s = 0)."""
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"\nmetrics = true\n',
               drain_grace_s=0)
    w.start()
    try:
        assert _wait_http(port, "/healthz")[0] == 200
        aid = cp.add_run(shell="/bin/sh", script="exec sleep 60")
        assert cp.wait(lambda: "running" in cp.acks_of(aid), 30), w.journal()
        before = scrape(port)
        assert before["qlagent_worker_self_fences_total"] == 0
        cp.partition(True)
        wait_until(lambda: scrape(port)["qlagent_worker_self_fences_total"] == 1, 20, "the run self-fenced",
                   detail=w.journal)
        # the Session (6 s) runs out at the control plane meanwhile
        assert cp.wait(lambda: all(s["expires"] <= now_us() for s in cp.sessions.values()), 10)
        # ... and the Worker says so: no Session, no round trip to show, not ready for want of an answer
        cut = wait_until(lambda: (m := scrape(port))["qlagent_worker_session_open"] == 0 and m, 10,
                         "the Session counted as lost", detail=w.journal)
        assert "qlagent_worker_heartbeat_rtt_seconds" not in cut
        status, body = _http(port, "/readyz")
        assert status == 503 and body["checks"]["session"] != "ok", body
        assert body["checks"]["control"].startswith("control_unreachable: "), body
        cp.partition(False)
        wait_until(lambda: scrape(port)["qlagent_worker_reconnects_total"] > before["qlagent_worker_reconnects_total"],
                   30, "a new Session", detail=w.journal)
        after = scrape(port)
        # (the stub offers the fenced Attempt again once its Lease ran out: live_runs may be 1 anew)
        assert after["qlagent_worker_session_open"] == 1 and after["qlagent_worker_self_fences_total"] == 1
        assert after["qlagent_worker_sessions_total"] == after["qlagent_worker_reconnects_total"] + 1
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()


class SlowLink(TcpProxy):
    """A TCP proxy to the control plane holding each piece of what the Worker sends for
    ``delay_s`` seconds before passing it on (0: at once), as a long or congested link does."""

    def __init__(self, upstream_port: int) -> None:
        self.delay_s = 0.0
        super().__init__(upstream_port)

    def _pipe(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while data := src.recv(65536):
                if outbound and self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        self._shut(src, dst)


def test_worker_heartbeat_rtt_follows_a_slow_link(tmp_path, cp):
    """A link that holds what the Worker sends for 0.5 s: the heartbeat round trip on the
    status surface rises to at least that; back to a plain link, it falls below it again."""
    delay_s = 0.5
    link = SlowLink(int(cp.url.rsplit(":", 1)[1]))
    port = free_port()
    w = Worker(tmp_path, cp, f"https://localhost:{link.port}",
               extra=f'\n[http]\nlisten = "127.0.0.1:{port}"\nmetrics = true\n')
    w.start()
    rtt = "qlagent_worker_heartbeat_rtt_seconds"
    try:
        assert _wait_http(port, "/healthz")[0] == 200
        wait_until(lambda: scrape(port).get(rtt, delay_s) < delay_s, 20, "a heartbeat answered over the plain link",
                   detail=w.journal)
        link.delay_s = delay_s
        wait_until(lambda: scrape(port)[rtt] >= delay_s, 20, "the round trip of a heartbeat over the slow link",
                   detail=w.journal)
        link.delay_s = 0.0
        wait_until(lambda: scrape(port)[rtt] < delay_s, 20, "the round trip back under the delay", detail=w.journal)
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()
        link.close()


def test_worker_metrics_are_off_unless_configured(tmp_path, cp):
    port = free_port()
    w = Worker(tmp_path, cp, cp.url, extra=f'\n[http]\nlisten = "127.0.0.1:{port}"')
    w.start()
    try:
        assert _wait_http(port, "/healthz")[0] == 200
        assert _http(port, "/metrics")[0] == 404
        assert w.stop() == 0
    finally:
        if w.p.poll() is None:
            w.kill()
