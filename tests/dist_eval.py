"""torchrun worker for tests/test_data_at_scale.py: train.val_loss on N ranks (DDP over gloo).

    python -m torch.distributed.run --nproc_per_node=N tests/dist_eval.py CONFIG.json OUT.json

Every rank builds the same seeded micro model from the TrainConfig in CONFIG.json and runs
`train.val_loss` with an `accelerate.Accelerator(cpu=True)`; rank 0 writes the result.
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import train  # noqa: E402
from config import TrainConfig  # noqa: E402
from model import Transformer  # noqa: E402


def main(config_json: str, out_json: str):
    cfg = TrainConfig(**json.loads(open(config_json).read()))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    metrics = train.val_loss(cfg, accelerator, model, data.token_bytes(cfg.data_dir),
                             cfg.data_dir)
    if accelerator.is_main_process:
        with open(out_json, "w") as f:
            json.dump({**metrics, "world": accelerator.num_processes}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
