"""`torchrun <options> train.py <arguments>` with its workers forked from this process, which imported train.py once.

`python torchrun_forked.py <torchrun's options> <path of train.py> <its arguments>` parses the command line with
torchrun's own code (`parse_args`, `config_from_args`) and launches with its launcher (`elastic_launch`: agent,
rendezvous, `TORCHELASTIC_*`); only the workers start differently: forked (elastic.worker) instead of executed, so each
does not pay ~9 s of CPU importing torch, Lightning and Hydra again.
"""

from __future__ import annotations

import sys
from pathlib import Path

from elastic import worker
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, parse_args

import train  # its imports: torch, Lightning, Hydra, the library

if __name__ == "__main__":
    options = parse_args(sys.argv[1:])
    if Path(options.training_script).resolve() != Path(train.__file__).resolve():
        raise SystemExit(f"torchrun_forked runs train.py only, not {options.training_script}")
    config, _, _ = config_from_args(options)
    config.start_method = "fork"
    elastic_launch(config, worker)(list(options.training_script_args))
