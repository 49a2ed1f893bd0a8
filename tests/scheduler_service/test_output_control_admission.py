"""The Engine API checks the output controls itself (a gRPC client need not come through the gateway): ids outside
the vocabulary, an empty bad word and two structured-output constraints at once are INVALID_ARGUMENT naming the
SamplingParams field; good controls are admitted."""

from __future__ import annotations

import pytest

from steploop.common.engine_contract import EngineRequest
from steploop.common.errors import InvalidRequestError
from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.config import SchedulerConfig
from steploop.scheduler.engine_loop import EngineLoop
from steploop.scheduler.server_config import ServerConfig
from steploop.scheduler.worker_link import WorkerLink
from tests.tp.test_worker_group import FakeStream, info

pytestmark = pytest.mark.asyncio


@pytest.fixture
def loop():
    engine = EngineLoop(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), ServerConfig())
    engine.attach(WorkerLink(FakeStream(), info(0, world=1, worker_id="w0")))
    return engine


@pytest.mark.parametrize("sampling, param", [
    (SamplingParams(allowed_token_ids=(1, 10**6)), "allowed_token_ids"),
    (SamplingParams(bad_words=((3,), (4, 10**6))), "bad_words"),
    (SamplingParams(bad_words=((),)), "bad_words"),
    (SamplingParams(regex="a", grammar='root ::= "a"'), "grammar"),
    (SamplingParams(json_object=True, structural_tag="{}"), "structural_tag"),
])
async def test_refused_naming_the_field(loop, sampling, param):
    with pytest.raises(InvalidRequestError) as err:
        loop.add_request(EngineRequest("r", [5] * 4, sampling))
    assert err.value.param == param


async def test_good_controls_are_admitted(loop):
    loop.add_request(EngineRequest("r", [5] * 4, SamplingParams(allowed_token_ids=(1, 2), bad_words=((3, 4),),
                                                                grammar='root ::= "a"')))
    assert loop.scheduler.num_waiting == 1
