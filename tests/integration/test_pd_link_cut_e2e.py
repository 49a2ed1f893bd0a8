"""The prefill-decode link cut mid-transfer: the prefill worker runs in its own network namespace, joined to this one
by two veth pairs, one for the scheduler's gRPC and one for the KV transfer to the decode worker's receiver. The KV
pair is rate-limited (tc tbf) so a transfer lasts seconds; once one is on the wire (an established connection to
the receiver) that pair is taken down, the scheduler link staying up. The send times out (--kv-transfer-timeout),
the requests are recomputed on the decode group: every one completes with transformers' greedy text, the fallbacks
and failures are counted, no block is left on either side. With the link back, a transfer succeeds again."""

from __future__ import annotations

import pathlib
import threading
import time

import pytest

from tests.integration.cluster import free_port
from tests.integration.netns import LinkedNamespace, can_make_namespaces
from tests.integration.pd_cluster import LONG, PROMPTS, assert_both_pools_whole, complete, metric, pd_cluster, stop

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not can_make_namespaces(),
                                 reason="this process may not create network namespaces (needs root or "
                                        "CAP_NET_ADMIN + CAP_SYS_ADMIN)")]

# Private /30s of their own (tests/integration/netns.py's default is 10.213.7.0/30): the scheduler link, the KV link.
CONTROL = ("10.213.9.1", "10.213.9.2")
KV = ("10.213.9.5", "10.213.9.6")
TRANSFER_TIMEOUT = 5.0


def established_to(host: str, port: int) -> bool:
    """An established TCP connection whose local end is host:port (the receiver's side, in this namespace)."""
    want = "{}:{:04X}".format("".join(f"{int(b):02X}" for b in reversed(host.split("."))), port)
    lines = pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(f[1] == want and f[3] == "01" for f in (line.split() for line in lines))


def test_cut_prefill_decode_link_mid_transfer_recomputes_locally(tmp_path, model_dir, hf):
    receiver_port = free_port()
    with LinkedNamespace(f"pd{int(time.time()) % 100000}", *CONTROL) as ns:
        kv_link = ns.add_link("k", *KV)
        kv_link.limit_rate("16mbit")         # ~18 blocks of 0.7 MB per LONG prompt: seconds on the wire
        cluster = pd_cluster(tmp_path, scheduler_host=CONTROL[0], prefill_prefix=ns.prefix(),
                             kv_transfer=(KV[0], receiver_port), transfer_timeout=TRANSFER_TIMEOUT)
        try:
            names = ("kv_transfers", "kv_transfer_failures", "fallbacks")
            before = {m: metric(cluster, f"steploop:pd_{m}_total") for m in names}
            results: dict[int, list[str]] = {}
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, complete(cluster, LONG[i], 8, disaggregation="disaggregated"))) for i in range(len(LONG))]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 180
            while not established_to(KV[0], receiver_port):
                assert time.monotonic() < deadline, "no KV transfer started:\n" + cluster.logs()
                time.sleep(0.01)             # a poll interval
            kv_link.cut()
            for t in threads:
                t.join(300)
            assert [results.get(i) for i in range(len(LONG))] == [[hf.greedy_text(hf.text_ids(p), 8)] for p in LONG]
            after = {m: metric(cluster, f"steploop:pd_{m}_total") for m in names}
            assert after["kv_transfers"] == before["kv_transfers"], "a transfer passed the cut link"
            assert after["fallbacks"] == before["fallbacks"] + len(LONG), after
            assert after["kv_transfer_failures"] >= before["kv_transfer_failures"] + 1, after
            assert metric(cluster, "steploop:pd_prefill_group_up") == 1, "the scheduler link was cut too"
            # The send failed on its own timeout (the prefill worker says so), not by the scheduler's lease.
            assert f"to {KV[0]}:{receiver_port} failed" in (tmp_path / "prefill.log").read_text()
            assert "outlived --kv-transfer-lease" not in (tmp_path / "scheduler.log").read_text()
            assert_both_pools_whole(cluster)

            kv_link.restore()                # the link back (unthrottled): transfers succeed again
            kv_link.unlimit()
            assert complete(cluster, PROMPTS[3], disaggregation="disaggregated") == \
                [hf.greedy_text(hf.text_ids(PROMPTS[3]), 8)]
            assert metric(cluster, "steploop:pd_kv_transfers_total") == after["kv_transfers"] + 1
            assert metric(cluster, "steploop:pd_fallbacks_total") == after["fallbacks"]
            assert_both_pools_whole(cluster)
        finally:
            stop(cluster)
