"""KV tiers under -tp 2: the real Scheduler drives two ModelRunner ranks (threads of this process, one gloo group)
over a pool too small for the conversations, so prefix blocks are demoted to host memory and disk and returning
turns restore them, each rank moving its own KV heads. Greedy tokens equal those of the same workload with tiers
off, and a block file lost on one rank only is a miss for the whole group (no rank loads what another lacks): the
text is still right."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from steploop.common.sampling_params import SamplingParams
from steploop.scheduler.request import Request
from tests.tp.tp_models import each_rank_in_a_thread
from tests.worker.test_kv_tiers_e2e import BLOCK, POOL, conversations, scheduler_for, serve

pytestmark = pytest.mark.slow


class RankGroup:
    """The ranks of one group as the scheduler sees them: each plan runs on every rank at once (their collectives
    need each other); rank 0 answers, and a rank that failed what rank 0 did not fails the test."""

    def __init__(self, runners):
        self.runners = runners
        self.pool = ThreadPoolExecutor(len(runners))

    def __getattr__(self, name):               # info, tiers, kv_caches: rank 0's
        return getattr(self.runners[0], name)

    def reset(self) -> None:
        for runner in self.runners:
            runner.reset()

    def execute(self, plan):
        results = list(self.pool.map(lambda runner: runner.execute(plan), self.runners))
        assert not any(r.error for r in results[1:]), [r.error for r in results]
        return results[0]


@pytest.fixture(scope="module")
def tp_tiers(tp2_model_dir, tmp_path_factory):
    from steploop.gpu_worker.config import WorkerConfig
    from steploop.gpu_worker.distributed.process_group import GroupStore, form_group
    from steploop.gpu_worker.model_runner import ModelRunner

    disk = tmp_path_factory.mktemp("tp-kv-disk")
    store = GroupStore("127.0.0.1", 2)

    def rank_main(rank: int):
        config = WorkerConfig(model=str(tp2_model_dir), num_kv_blocks=POOL, max_model_len=(POOL - 1) * BLOCK,
                              device="cpu", dtype="float32", block_size=BLOCK, tensor_parallel_size=2, rank=rank,
                              num_threads=1, kv_offloading_size=0.00012, kv_disk_path=str(disk), kv_disk_size=0.01)
        runner = ModelRunner.from_config(config, tp2_model_dir)
        timeout = timedelta(seconds=120)
        runner.tp_comm.attach(form_group(rank, 2, store.address, 1, timeout, "127.0.0.1", torch.device("cpu"),
                                         store if rank == 0 else None), 1, timeout)
        return runner

    group = RankGroup(each_rank_in_a_thread(2, rank_main))
    # a rank's block is 8 KiB (2 layers, its one KV head): 15 host slots, so long prompts reach the disk
    assert [r.tiers.num_host_blocks for r in group.runners] == [15, 15]
    assert group.runners[0].tiers.disk.folder != group.runners[1].tiers.disk.folder
    return group


def test_tiers_on_and_off_give_the_same_tokens_under_tp(tp_tiers):
    want = serve(tp_tiers, scheduler_for(tp_tiers, False), conversations())
    sched = scheduler_for(tp_tiers, True)
    assert serve(tp_tiers, sched, conversations()) == want
    stats = sched.kv.tiers.stats
    assert stats["CPU"].blocks_in > 0 and stats["CPU"].hits > 0, "nothing was demoted and restored"


def test_a_block_file_lost_on_one_rank_is_a_miss_for_the_group(tp_tiers):
    import random
    long_prompt = [random.Random(7).randrange(100, 20000) for _ in range(150)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = serve(tp_tiers, scheduler_for(tp_tiers, False), [[Request("ref", long_prompt, sampling=greedy)]])
    sched = scheduler_for(tp_tiers, True)
    filler = [[Request(f"f{i}", [random.Random(i).randrange(100, 20000) for _ in range(190)],
                       sampling=SamplingParams(max_tokens=1))] for i in range(6)]
    serve(tp_tiers, sched, [[Request("a", long_prompt, sampling=greedy)]] + filler)
    assert sched.kv.tiers.stats["DISK"].blocks_in > 0, "nothing reached the disk"
    for f in tp_tiers.runners[1].tiers.disk.folder.glob("*.kvb"):     # rank 1 loses every file; rank 0 keeps its
        f.unlink()
    got = serve(tp_tiers, sched, [[Request("b", long_prompt, sampling=greedy)]])
    assert got["b"] == want["ref"]
    assert sched.kv.tiers.stats["DISK"].misses > 0, "rank 1's misses did not count for the group"
