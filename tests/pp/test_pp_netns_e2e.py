"""A -pp 2 group across two "hosts": the last stage in its own network namespace (a veth pair), the first stage,
scheduler and gateway in this one. Cutting the link mid-stream (no FIN, no RST) breaks the group: the first
stage's send of a step's hidden states times out, keepalive drops the last stage's plan stream; once the link is
back the group re-forms and every stream ends with transformers' text (the scenario of tests/tp/test_tp_netns_e2e.py
with the stages in place of the tensor-parallel ranks)."""

from __future__ import annotations

import pytest

from tests.integration.netns import netns_available
from tests.tp.test_tp_netns_e2e import cut_link_scenario

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not netns_available(), reason="needs root and iproute2 for network namespaces")]


def test_stages_on_two_hosts_survive_a_cut_link(tmp_path, pp_llama_dir):
    cut_link_scenario(tmp_path, pp_llama_dir, "pipeline", pipeline_parallel_size=2)
