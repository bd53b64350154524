"""TM801: the commands that start the program, in shell scripts, Makefiles, SLURM batch files and
README code blocks. The work is done on text by `torchmigrate.launchers` (no Python is parsed);
this class carries the rule's code, documentation and examples for the catalogue."""

from __future__ import annotations

from torchmigrate.finding import Safety
from torchmigrate.rule import Example, Rule


class DistLaunch(Rule):
    """
    ## What it does
    Finds the commands that start a file of the program in `*.sh`, `*.sbatch`/`*.slurm`,
    `Makefile`/`*.mk` and the shell code blocks of `*.md`/`*.rst` (`torchmigrate ddp` looks in
    the folders named, in the project of each script named and in the launch files named, whose
    scripts it then migrates; `lint` in the folders and launch files named), and rewrites
    `python -m torch.distributed.launch` commands to `torchrun`:

    - `--nproc_per_node`, `--node_rank`, `--master_addr`, ... get torchrun's spelling
      (`--nproc-per-node`, ...); `--use_env` goes, and so does a `--local_rank` argument given
      to the script (torchrun sets `LOCAL_RANK` and passes no argument).
    - One node (no `--nnodes` or `--nnodes=1`, the master on this host) gets `--standalone`
      instead of `--master_addr`/`--master_port` (a free port: two jobs on one machine no longer
      collide); several nodes keep `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`.
    - `python`/`python3` (and `-u`: torchrun starts its workers unbuffered, as the launcher did)
      becomes `torchrun`; an interpreter given by path or variable (`$PYTHON`,
      `/opt/env/bin/python`) is kept and runs `-m torch.distributed.run`, which is torchrun.
    - Prefixes (`CUDA_VISIBLE_DEVICES=0,1,2,3`, which still picks the GPUs the node's processes
      see; `srun`, `nohup`), the script's arguments, redirections, continuation lines and every
      other byte of the file are kept. `torchrun` and `python -m torch.distributed.run` commands
      are torchrun already and are left as they are.

    Only commands whose script is a file of the program are rewritten (`src/train.py`,
    `-m pkg.train`, resolved from the file's folder, a `cd` before the command, the project root
    or, for a README, the one program file with that name). A command that starts one process
    (`python train.py`, `srun python train.py`) stays valid; the migration report notes how to
    scale it.

    Ranks started by hand in a loop (`for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python
    train.py --local_rank $i & done; wait`) become the one torchrun command that starts the same
    processes (`torchrun --standalone --nproc-per-node=4 train.py`), when the loop is plain: a
    `for` over `0 1 ... N-1` (or `{0..3}`, `$(seq 0 3)`, `((r = 0; r < $N; r++))` with `N` set
    in the file), one backgrounded command per iteration that gives the loop variable as the
    rank (`RANK=`, `LOCAL_RANK=`, `--local_rank`) and nowhere else but `CUDA_VISIBLE_DEVICES=`,
    `WORLD_SIZE=` the count, `MASTER_ADDR=` this host. Those variables and `--local_rank` go; a
    bare `wait` right after the loop goes with it (else the torchrun command ends with `&`).

    Reported with the torchrun command to use, and left as written: launcher options that come
    from a variable (`$DIST_ARGS`), a launcher kept in a variable, an option torchrun does not
    know, ranks started by hand in any other way (a `while` loop, per-rank arguments or logs
    such as `> log.$i`, background processes passing `--local_rank`), and a script that parses
    `--local_rank` without reading `LOCAL_RANK` (fix it with TM102 first).
    `# torchmigrate: ignore[TM801]` on a command's line keeps it.

    ## Why is this bad?
    `torch.distributed.launch` is deprecated and passes `--local-rank=N` to the script unless
    given `--use_env`; the migrated program runs under torchrun, which only sets `LOCAL_RANK`.
    A README or a job script that still starts it the old way starts it the wrong way, and
    the deprecated launcher will go away.

    ## Example
    ```sh
    python -m torch.distributed.launch --nproc_per_node=4 --use_env train.py --lr 0.1
    ```
    becomes
    ```sh
    torchrun --standalone --nproc-per-node=4 train.py --lr 0.1
    ```
    """

    code = "TM801"
    name = "dist-launch"
    summary = "Start the program with torchrun in shell scripts, Makefiles, SLURM files and READMEs"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            file="run.sh",
            before="""
            #!/bin/bash
            CUDA_VISIBLE_DEVICES=0,1,2,3 python -m torch.distributed.launch --nproc_per_node=4 \\
                --master_port=29501 --use_env train.py --epochs 90 --local_rank 0
            """,
            after="""
            #!/bin/bash
            CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --standalone --nproc-per-node=4 \\
                train.py --epochs 90
            """,
        ),
        Example(
            file="job.sbatch",
            before="""
            #SBATCH --nodes=2
            srun python3 -u -m torch.distributed.launch --nproc_per_node=8 --nnodes=2 \\
                --node_rank=$SLURM_NODEID --master_addr=$MASTER_ADDR --master_port=29500 train.py
            """,
            after="""
            #SBATCH --nodes=2
            srun torchrun --nproc-per-node=8 --nnodes=2 \\
                --node-rank=$SLURM_NODEID --master-addr=$MASTER_ADDR --master-port=29500 train.py
            """,
        ),
        Example(
            file="run.sh",
            before="""
            for i in 0 1 2 3; do
                CUDA_VISIBLE_DEVICES=$i python train.py --local_rank $i --epochs 90 &
            done
            wait
            """,
            after="""
            torchrun --standalone --nproc-per-node=4 train.py --epochs 90
            """,
        ),
        Example(
            file="README.md",
            before="""
            ```bash
            python train.py --gpu 0                  # one GPU: stays, the report says how to scale
            python -m torch.distributed.launch --nproc_per_node=2 $DIST_ARGS train.py   # reported
            ```
            """,
        ),
    )
