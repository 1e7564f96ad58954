"""torchrun worker for tests/test_ranks.py: what only several ranks show, in one launch (DDP
over gloo, every rank an `accelerate.Accelerator(cpu=True)` as train.py makes it).

    python -m torch.distributed.run --nproc_per_node=N tests/dist_ranks.py PLAN.json OUT

PLAN.json holds TrainConfigs (as dataclasses.asdict gives them), each taken in turn:

  too_big      train.setup of a plan whose memory estimate fits the machine's RAM but not
               its share per rank: the refusal's message, and with force=True, the error
               setup stops at next (its data_dir does not exist).
  run          train.main on a data_dir no process has checked (no checked.json), with a
               downstream task: the shard files this rank hashed (shards.scan_shard, slowed
               down to a real corpus's pace), and of the first scoring, this rank's vector
               of log-likelihoods before the ranks' sum and the number of forwards it ran.
  evaluations  train.val_loss of each, on a model seeded with 0.

Every rank writes OUT/rank<r>.json.
"""

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import train  # noqa: E402
from config import TrainConfig  # noqa: E402
from model import Transformer  # noqa: E402
from plumbing import downstream, shards  # noqa: E402


def refusals(cfg: TrainConfig) -> dict:
    said = {}
    for force in (False, True):
        try:
            train.setup(cfg, force)
        except train.USER_ERRORS as e:
            said["forced" if force else "refused"] = str(e)
    return said


def run(cfg: TrainConfig) -> dict:
    """train.main, watched: the shard files this process hashes, and the first scoring."""
    hashed, scorings = [], []
    scan, loglikelihoods = shards.scan_shard, downstream.loglikelihoods

    def counting_scan(path, dtype):
        hashed.append(path.name)
        # Hashing a real corpus takes minutes: slowed down here, a rank that did not wait
        # for rank 0 would find no record yet and hash the shards again.
        time.sleep(0.5)
        return scan(path, dtype)

    def watched(task, model, *args):
        forwards = []
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        lls = loglikelihoods(task, model, *args)
        hook.remove()
        scorings.append({"lls": lls.tolist(), "forwards": len(forwards)})
        return lls
    shards.scan_shard, downstream.loglikelihoods = counting_scan, watched
    try:
        train.main(cfg)
    finally:
        shards.scan_shard, downstream.loglikelihoods = scan, loglikelihoods
    return {"hashed": sorted(hashed), "scoring": scorings[0]}


def evaluations(configs: list[TrainConfig]) -> list[dict]:
    accelerator, results = Accelerator(cpu=True), []
    for cfg in configs:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        results.append(train.val_loss(cfg, accelerator, model, data.token_bytes(cfg.data_dir),
                                      cfg.data_dir))
    return results


def main(plan_json: str, out: str):
    plan = json.loads(Path(plan_json).read_text())
    result = {**refusals(TrainConfig(**plan["too_big"])), **run(TrainConfig(**plan["run"])),
              "evaluations": evaluations([TrainConfig(**c) for c in plan["evaluations"]])}
    accelerator = Accelerator(cpu=True)
    result["world"] = accelerator.num_processes
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
