"""Multi-process tests of torchmigrate.runtime: real torchrun / SLURM-style launches on this machine
(gloo on CPU; the nccl variant runs only where two GPUs are visible).

Each launch runs a probe from tests/runtime_probe/ that writes one JSON file per rank; the tests
compare the ranks' observations."""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch

from launcher import Launch, launch_retrying_gloo_abort, torchrun, torchrun_cmd

PROBES = Path(__file__).parent / "runtime_probe"
TIMEOUT = 120
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    """This environment without launcher variables, single-threaded, unbuffered."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "TORCHMIGRATE_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class LaunchError(AssertionError):
    """A launch group failed; `run_with_free_port` reads its report to decide on a new port."""


def run_group(cmds, envs, stale) -> Launch:
    """Start processes that rendezvous with each other, retrying the whole group once on the gloo
    exit abort; any failure raises with every process's full output."""
    result = launch_retrying_gloo_abort(cmds, envs, timeout=TIMEOUT, stale=stale)
    if result.returncode:
        raise LaunchError(result.report())
    return result


def run_with_free_port(launch):
    """``launch(port)`` with a free port; one retry with another port if someone else grabbed it
    between our probe and the rendezvous (other test suites share this machine)."""
    try:
        return launch(free_port())
    except LaunchError as e:
        if "address already in use" not in str(e).lower() and "EADDRINUSE" not in str(e):
            raise
        return launch(free_port())


def read_ranks(outdir: Path, world: int) -> list[dict]:
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(world)]


# ------------------------------------------------------------------ one node, two processes

@pytest.fixture(scope="module", params=[
    "gloo", pytest.param("nccl", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs"))])
def collectives(request, tmp_path_factory):
    """Run tests/runtime_probe/collectives.py under torchrun with 2 processes, once per backend."""
    outdir = tmp_path_factory.mktemp(f"collectives_{request.param}")
    extra = {"CUDA_VISIBLE_DEVICES": ""} if request.param == "gloo" else {}
    run = torchrun("--standalone", "--nproc-per-node=2", PROBES / "collectives.py", outdir,
                   env=clean_env(**extra), timeout=TIMEOUT, stale=[outdir / "*"])
    assert run.returncode == 0, run.report()
    return {"backend": request.param, "outdir": outdir, "output": run.output, "ranks": run.ranks,
            "r": read_ranks(outdir, 2)}


def test_setup_context(collectives):
    r0, r1 = collectives["r"]
    assert [r["ctx"]["rank"] for r in (r0, r1)] == [0, 1]
    assert [r["ctx"]["local_rank"] for r in (r0, r1)] == [0, 1]
    assert [r["ctx"]["is_main"] for r in (r0, r1)] == [True, False]
    for r in (r0, r1):
        assert r["ctx"]["world_size"] == r["pg_world"] == 2 and r["is_distributed"]
        assert r["backend"] == collectives["backend"]
        assert r["same_ctx"]
    if collectives["backend"] == "nccl":
        assert [r["ctx"]["device"] for r in (r0, r1)] == ["cuda:0", "cuda:1"]
    else:
        assert r0["ctx"]["device"] == r1["ctx"]["device"] == "cpu"
    # cleanup() destroyed the process group (and a second cleanup() did not fail)
    for rank in (0, 1):
        assert (collectives["outdir"] / f"rank{rank}.done").read_text() == "False"


def test_all_reduce_numbers_and_tensors(collectives):
    dev = "cuda" if collectives["backend"] == "nccl" else "cpu"
    for r in collectives["r"]:
        assert r["sum_int"] == {"value": 3, "type": "int"}
        assert r["sum_big_int"] == {"value": 2 * 2 ** 60 + 1, "type": "int"}  # exact, not float
        i, f, t, it, bt = r["sum_mixed"]
        assert i == {"value": 3, "type": "int"}
        assert f == {"value": 1.5, "type": "float"}
        assert t == {"value": [1.0, 20.0], "type": "tensor", "dtype": "torch.float32",
                     "device": dev}
        assert it["value"] == [3, 4] and it["dtype"] == "torch.int64" and it["device"] == "cpu"
        assert bt["value"] == [2, 1] and bt["dtype"] == "torch.int64"  # bool sum counts
        mi, mf, mt, mit = r["mean"]
        assert mi == {"value": 1.5, "type": "float"} and mf == {"value": 1.0, "type": "float"}
        assert mt["value"] == [1.0, 4.0] and mt["device"] == dev
        assert mit["value"] == [0.5, 3.0] and mit["dtype"] == "torch.float32"
        assert [v["value"] for v in r["max"]] == [1, 0.0, [1, 0]]
        assert [v["type"] for v in r["max"]] == ["int", "float", "tensor"]
        assert [v["value"] for v in r["min"]] == [0, -1.0, [0, -1]]
        assert r["bf16"]["value"] == [3.0, 1.0] and r["bf16"]["dtype"] == "torch.bfloat16"
        assert r["input_untouched"]
        assert r["lists"] == ["list", [1, 4], "tuple", [0.5, 2.0], 1, True]
        assert r["list_mean"] == [0.5, 1.0]
        assert r["dicts"] == ["dict", [[0, 0.25], [1, 1.5]], [[0, 1], [1, 4]]]
        assert r["numpy"] == ["ndarray", [1.0, 2.0]]


def test_broadcast_object_and_shared_generator_agree_across_ranks(collectives):
    r0, r1 = collectives["r"]
    assert r0["broadcast"] == r1["broadcast"]
    assert r0["broadcast_tensor"] == r1["broadcast_tensor"]
    assert r0["split"] == r1["split"]
    assert sorted(r0["split"][0] + r0["split"][1]) == list(range(12))


def test_every_rank_starts_from_rank_0s_random_streams_until_training_sets_them_apart(collectives):
    r0, r1 = collectives["r"]
    assert r0["first_draws"] == r1["first_draws"]
    assert all(a != b for a, b in zip(r0["draws_after_seed_per_rank"], r1["draws_after_seed_per_rank"]))


def test_input_is_asked_on_the_main_process_and_answered_on_every_rank(collectives):
    r0, r1 = collectives["r"]
    assert r0["input"] == r1["input"] == "answer of rank 0"
    assert r0["input_error"] == r1["input_error"] == "no stdin"  # no rank waits for an answer
    assert r0["input_alone"] is None and r1["input_alone"] is True  # asked by rank 1 alone: an error, no hang


def test_a_rank_loading_what_rank_0_saves_waits_for_that_save(collectives):
    r0, r1 = collectives["r"]
    assert r0["loaded_after_save"] == r1["loaded_after_save"] == 2


def test_bar_stream_counts_on_every_rank_and_draws_on_the_main_one(collectives):
    r0, r1 = collectives["r"]
    assert r0["bar_n"] == r1["bar_n"] == 3
    assert (r0["bar_stream"], r1["bar_stream"]) == ("default", "null")


def test_parameters_stepped_beside_a_wrapped_model_are_averaged(collectives):
    """A loss module's parameter in the wrapped model's optimizer stays equal on every rank;
    one with an optimizer of its own is the program's to keep per rank."""
    r0, r1 = collectives["r"]
    assert r0["stray_proxy"] == pytest.approx(r1["stray_proxy"])
    assert r0["stray_alone"] != r1["stray_alone"]


def test_share_params_and_sync_grads_do_what_ddp_does(collectives):
    r0, r1 = collectives["r"]
    assert r0["shared_params"] == r1["shared_params"]
    assert r0["own_grad"] != r1["own_grad"]
    mean = [(a + b) / 2 for a, b in zip(r0["own_grad"], r1["own_grad"])]
    assert r0["synced_grad"] == r1["synced_grad"] == pytest.approx(mean)


def test_synced_runs_a_loss_method_through_ddp_so_its_gradients_are_averaged(collectives):
    r0, r1 = collectives["r"]
    assert r0["method_grad"] != r1["method_grad"]  # through tm.unwrap: each rank its own
    mean = [(a + b) / 2 for a, b in zip(r0["method_grad"], r1["method_grad"])]
    assert r0["synced_method_grad"] == r1["synced_method_grad"] == pytest.approx(mean)
    assert r0["forward_after_synced"] and r1["forward_after_synced"]


def test_shard_stream_and_any_rank(collectives):
    r0, r1 = collectives["r"]
    assert (r0["stream"], r1["stream"]) == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    assert len(r0["dealt"]) == len(r1["dealt"]) == 7 and set(r0["dealt"]) | set(r1["dealt"]) == set(range(13))
    assert r0["dealt"] != list(range(7))  # dealt, not cut
    # a dataset object of the program: a view of this rank's dealt samples, indexed one by one
    assert len(r0["dataset_part"]) == len(r1["dataset_part"]) == 5
    assert set(r0["dataset_part"]) | set(r1["dataset_part"]) == set(range(9))
    assert r0["dataset_part_vocab"] == {"a": 0}
    assert r0["any_rank"] == r1["any_rank"] == [True, False]
    assert r0["all_ranks"] == r1["all_ranks"] == [False, True]
    assert r0["batch_totals"] == r1["batch_totals"] == [1.5, 3.0, 3.0, 1.5, True]  # a progress bar: its loader
    assert r0["agreed"] == r1["agreed"] and r0["agreed"][0] != r0["agreed"][1]  # alike, new each call
    # one hash salt for every rank (set iteration order, hash(str)), chosen from the run
    assert r0["set_order"] == r1["set_order"] and r0["hash_seed"] == r1["hash_seed"]
    assert r0["hash_seed"][0] not in (None, "random", "0")
    # an evaluation set that draws, read whole: alike on every rank (also through workers), new
    # each pass, the rank's own stream kept; the loader keeps its class and attributes
    assert r0["same_draws"] == r1["same_draws"] and r0["same_draws"][0] != r0["same_draws"][1]
    assert r0["same_draws_workers"] == r1["same_draws_workers"]
    assert r0["own_draws"] != r1["own_draws"]  # (without it each rank draws its own, after seed_per_rank)
    assert r0["same_draws_kept_own"] and r1["same_draws_kept_own"]
    assert r0["same_draws_loader"] == [True, 2, 2, "DataLoader", True]
    assert sorted(r0["agreed"][0]) == list(range(10)) and r0["agreed_kept_own"] and r1["agreed_kept_own"]
    assert r0["agreed_own"] == r1["agreed_own"] == r0["agreed_own_expected"]  # as `python train.py` draws
    assert r0["agreed_reseeded"] == r1["agreed_reseeded"] == r0["agreed_reseeded_expected"]  # seeded again
    assert r0["placed"] == r1["placed"] == "rank 0" and r0["temps_left"] == r1["temps_left"] == []


def test_gather_list_gathers_what_a_sharded_loop_collected_and_keeps_a_whole_one(collectives):
    r0, r1 = collectives["r"]
    assert r0["gather_list"] == r1["gather_list"]
    assert sorted(v for batch in r0["gather_list"] for v in batch) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert r0["gather_list_whole"] == r1["gather_list_whole"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


def test_a_meter_kept_across_epochs_is_reduced_by_what_it_gained(collectives):
    """Epoch 1 adds 1 (rank 0) and 2 (rank 1), epoch 2 adds 2 and 4: reduced after each epoch, the
    kept meter holds 9 over 4 updates (reduced whole again, it would hold 3 + 2*3 + 6 = 15); a
    meter reset each epoch holds that epoch's 3 over 2."""
    r0, r1 = collectives["r"]
    assert r0["meter_kept"] == r1["meter_kept"] == [9.0, 4, 3.0, 2]
    # per-class sums in a numpy array (3DUNet's DiceAverage): reduced, not skipped
    assert r0["meter_arrays"] == r1["meter_arrays"] == [[3.0, 2.0], 2, [1.5, 1.0]]


def test_on_main_picks_once_for_every_rank(collectives):
    """A helper that probes for a free folder runs on the main process alone: every rank gets
    `run-01`, then `run-02` and `run-03` from a helper that calls it twice (nested calls run in
    place), and no other folder is made; an error on the main process is raised on every rank; a
    result that does not pickle is made by each rank for itself; a broadcast inside is in place."""
    r0, r1 = collectives["r"]
    runs = str(collectives["outdir"] / "runs")
    picks = [os.path.join(runs, f"run-0{k}") for k in (1, 2, 3)]
    assert r0["on_main"] == r1["on_main"] == [picks[0], picks[1:]]
    assert r0["on_main_folders"] == r1["on_main_folders"] == ["run-01", "run-02", "run-03"]
    assert r0["on_main_error"] == r1["on_main_error"] == "KeyError('missing')"
    assert r0["on_main_local"] == r1["on_main_local"] == [1, False]
    assert r0["on_main_broadcast"] == r1["on_main_broadcast"] == "from rank 0"  # no collective inside
    assert r0["worker_draws"] == r1["worker_draws"] == 2  # in a data-loader worker: run in place


def test_leftover_accumulated_gradients_are_averaged_before_the_step(collectives):
    """An optimizer step on gradients accumulated under no_sync() that no backward averaged (an
    epoch ending inside an accumulation window) averages them first: the ranks stay equal."""
    r0, r1 = collectives["r"]
    assert r0["accum_params"] == r1["accum_params"]
    assert "accumulated under no_sync()" in collectives["output"]


def test_shuffled_eval_sampler_covers_every_sample_once_in_a_new_order_each_pass(collectives):
    r0, r1 = collectives["r"]
    for p in range(2):
        assert sorted(r0["eval_shuffled"][p] + r1["eval_shuffled"][p]) == list(range(9))
    assert r0["eval_shuffled"][0] != r0["eval_shuffled"][1]


def test_train_sampler_partitions_and_reshuffles(collectives):
    r0, r1 = collectives["r"]
    assert "DistributedSampler" in r0["train_sampler_type"]
    for epoch in range(2):
        a, b = r0["train_epochs"][epoch], r1["train_epochs"][epoch]
        assert len(a) == len(b) == 5
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(10))
    assert r0["train_epochs"][0] != r0["train_epochs"][1]


def test_eval_sampler_covers_odd_dataset_once(collectives):
    r0, r1 = collectives["r"]
    assert r0["eval_indices"] == [0, 2, 4, 6] and r1["eval_indices"] == [1, 3, 5]
    assert sorted(r0["eval_indices"] + r1["eval_indices"]) == list(range(7))


def test_gather_for_metrics_restores_dataset_order(collectives):
    dev = "cuda" if collectives["backend"] == "nccl" else "cpu"
    for r in collectives["r"]:
        assert r["gathered"] == [10.0 * i + 1 for i in range(7)]
        assert r["gathered_device"] == dev
        assert r["gathered_feats"] == [[i, -i] for i in range(7)]
        assert r["gathered_dict"] == [[10.0 * i + 1 for i in range(5)], [[i, -i] for i in range(5)]]
        # DistributedSampler(shuffle=False) padded each rank to 4; total_len drops the padding
        assert r["padded_len"] == 4
        assert r["gathered_padded"] == [10.0 * i for i in range(7)]


def test_reductions_over_a_loader_reduce_only_a_sharded_one(collectives):
    """`over=loader`: the sum of a loader every rank iterates in full is the whole set's on every
    rank already and comes back unchanged (reduced again it would count each sample twice);
    over an `eval_sampler` shard the per-rank parts add up to the whole set."""
    whole = sum(10.0 * i for i in range(7))
    for r in collectives["r"]:
        assert r["sharded"] == [False, True, True, False]
        assert r["over_whole"] == [whole, 7]
        assert r["over_sharded"] == [whole, 7]
        assert r["over_mean"] == whole
        assert r["gathered_whole"] == [10.0 * i for i in range(7)]
        assert r["meter_whole"] == [whole, 7]


def test_save_only_rank0_writes(collectives):
    outdir = collectives["outdir"]
    assert sorted(os.listdir(outdir / "ckpt")) == ["model.pt"]  # one file, no temp leftovers
    assert torch.load(outdir / "ckpt" / "model.pt")["rank"] == 0
    assert [r["loaded_rank"] for r in collectives["r"]] == [0, 0]
    # main_only: the real object on rank 0, the null object (no file) elsewhere
    assert [r["main_only"] for r in collectives["r"]] == ["Writer", "_Null"]
    assert (outdir / "writer0.txt").exists() and not (outdir / "writer1.txt").exists()


def test_main_process_first_downloads_once_on_rank_0_first(collectives):
    log = (collectives["outdir"] / "data" / "log.txt").read_text().splitlines()
    assert log == ["0 downloaded", "1 found"]  # rank 0's block ran first and alone
    assert [r["download_found"] for r in collectives["r"]] == [False, True]
    assert [r["download_content"] for r in collectives["r"]] == ["downloaded by rank 0"] * 2


def test_ddp_keeps_ranks_identical(collectives):
    r0, r1 = collectives["r"]
    assert r0["is_ddp"] and r1["is_ddp"]
    assert r0["wrap_twice_same"] and r0["unwrap_is_plain"] and not r0["frozen_wrapped"]
    assert r0["nested_ddp"] == r1["nested_ddp"] == 1  # a wrapped model inside another: unwrapped there
    assert r0["counters_everywhere"] and r1["counters_everywhere"]  # thop-style per-module buffers
    assert r0["inner_released"] and r1["inner_released"]  # and the inner wrapper no longer waits for forwards
    assert r0["nested_grads"] == r1["nested_grads"]  # reduced once, the same on both ranks
    assert r0["params_init"] != r1["params_init"]  # seeded per rank before wrapping
    assert r0["params_before"] == r1["params_before"]  # DDP broadcast rank 0's weights
    assert r0["params_after"] != r0["params_before"]  # training happened
    assert r0["params_after"] == r1["params_after"]  # on different data, yet identical
    assert r0["reload_ok"] and r1["reload_ok"]
    assert r0["state_keys_plain"] and r1["state_keys_plain"]  # the wrapper saves the module's keys
    assert r0["names_plain"] and r1["names_plain"]  # and names its parameters as the module does
    # a project object holding the trained module: the module is wrapped in place, gradients averaged
    assert r0["holder_wrapped"] and r1["holder_wrapped"] and r0["holder_params"] == r1["holder_params"]


def test_no_sync_skips_gradient_allreduce(collectives):
    r0, r1 = collectives["r"]
    assert r0["grads_nosync"] != r1["grads_nosync"]  # local gradients only
    assert r0["grads_synced"] == r1["grads_synced"]  # the synced backward reduced the sum


def test_print_and_logging_once(collectives):
    """tm.print and INFO logging on rank 0 only; warnings on every rank (each rank's own output)."""
    def markers(text):
        return [ln for ln in text.splitlines() if "-MARKER" in ln]
    r0, r1 = collectives["ranks"]
    assert markers(r0) == ["PRINT-MARKER from rank 0", "INFO-MARKER from rank 0",
                           "WARN-MARKER from rank 0"]
    assert markers(r1) == ["WARN-MARKER from rank 1"]


# ------------------------------------------------------------------ other launchers

def check_training(ranks, world):
    assert [r["rank"] for r in ranks] == list(range(world))
    assert all(r["world_size"] == world and r["pg"] == world for r in ranks)
    assert ranks[0]["params_init"] != ranks[1]["params_init"]
    assert ranks[0]["params"] != ranks[0]["params_init"]
    for r in ranks[1:]:
        assert r["params"] == ranks[0]["params"]
        assert r["loss_sum"] == pytest.approx(ranks[0]["loss_sum"])
    assert [r["count"] for r in ranks] == [world * (world + 1) // 2] * world


def test_cleanup_releases_ddp_wrapper(tmp_path):
    """cleanup() frees the wrapper's Reducer and the gloo group although the script still holds
    `model` (else gloo can abort a rank at interpreter exit); the wrapper still runs forward and
    a local backward afterwards."""
    run = torchrun("--standalone", "--nproc-per-node=2", PROBES / "release.py", tmp_path,
                   env=clean_env(CUDA_VISIBLE_DEVICES=""), timeout=TIMEOUT,
                   stale=[tmp_path / "*"])
    assert run.returncode == 0, run.report()
    for r in read_ranks(tmp_path, 2):
        assert "DistributedDataParallel" in r["wrapped"]
        assert r["pg_after"] is False
        assert r["attrs"] == [True, True, True]
        assert r["reducer_freed"] and r["group_freed"]
        assert r["eval_same"] and r["grads"] and r["unwrap_same"]


def test_gradient_penalty_backpropagated_alone_through_ddp(tmp_path):
    """`gp.backward()` of a penalty from `tm.grad(..., create_graph=True)` through a DDP critic,
    after the critic's own backward: no "Expected to have finished reduction" at the next
    forward, and the parameters stay equal across ranks that drew different batches."""
    run = torchrun("--standalone", "--nproc-per-node=2", PROBES / "penalty.py", tmp_path,
                   env=clean_env(CUDA_VISIBLE_DEVICES=""), timeout=TIMEOUT, stale=[tmp_path / "*"])
    assert run.returncode == 0, run.report()
    r0, r1 = read_ranks(tmp_path, 2)
    assert r0["params"] == r1["params"]


def test_two_nodes_on_localhost(tmp_path):
    """Two torchrun agents (--nnodes=2), one process each, meet through a c10d rendezvous on
    127.0.0.1 (as on a cluster without a fixed master: the first agent hosts the store)."""
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    run_with_free_port(lambda port: run_group(
        [torchrun_cmd("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two-nodes-{port}",
                      PROBES / "train.py", tmp_path) for _ in (0, 1)], [env, env],
        stale=[tmp_path / "rank*.json"]))
    ranks = read_ranks(tmp_path, 2)
    check_training(ranks, 2)
    assert [r["local_rank"] for r in ranks] == [0, 0]


def test_slurm_two_tasks_without_torchrun(tmp_path):
    """Two plain `python` processes with only SLURM variables (what `srun -n 2` gives)."""
    def launch(port):
        envs = [clean_env(CUDA_VISIBLE_DEVICES="", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                          SLURM_NTASKS="2", SLURM_JOB_ID="4242", MASTER_PORT=str(port))
                for r in (0, 1)]
        run_group([[sys.executable, PROBES / "train.py", tmp_path]] * 2, envs,
                  stale=[tmp_path / "rank*.json"])
        return port

    port = run_with_free_port(launch)
    ranks = read_ranks(tmp_path, 2)
    check_training(ranks, 2)
    for r in ranks:  # setup() exported the torchrun names
        assert r["env"] == {"RANK": str(r["rank"]), "LOCAL_RANK": str(r["rank"]),
                            "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}


# ------------------------------------------------------------------ the safety nets of wrap_model

@pytest.fixture(scope="module")
def nets(tmp_path_factory):
    """tests/runtime_probe/nets.py under torchrun, 2 gloo ranks: never calls tm.setup() itself,
    imports a module whose top level calls tm.cleanup(), trains models that plain DDP cannot."""
    outdir = tmp_path_factory.mktemp("nets")
    env = clean_env(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(PROBES))
    run = torchrun("--standalone", "--nproc-per-node=2", PROBES / "nets.py", outdir,
                   env=env, timeout=TIMEOUT, stale=[outdir / "*"])
    assert run.returncode == 0, run.report()
    return {"outdir": outdir, "output": run.output, "r": read_ranks(outdir, 2)}


def test_a_head_the_loss_never_reads_trains_identically_with_one_warning(nets):
    r0, r1 = nets["r"]
    assert r0["heads_mode"] == r1["heads_mode"] == "manual"
    assert r0["fresh"] == r1["fresh"] == ["TwoHeads", False, True]  # type(model)() builds a plain model
    assert r0["heads"] == r1["heads"]  # a parameter used outside forward is averaged too
    warnings_ = [line for line in nets["output"].splitlines() if "got no gradient" in line and "TwoHeads" in line]
    assert len(warnings_) == 1 and "aux.weight, aux.bias" in warnings_[0]


def test_steps_through_submodules_are_averaged_and_plain_models_keep_ddp(nets):
    r0, r1 = nets["r"]
    assert r0["plain_mode"] == r1["plain_mode"] == "ddp"
    assert r0["plain"] == r1["plain"]
    assert r0["routed"] == r1["routed"]  # tm.synced(model).encoder(x) runs through DDP's forward
    assert r0["late_init"] == r1["late_init"]  # weights initialised after the wrap: rank 0's at the first step
    assert r0["rewrapped"] is r1["rewrapped"] is True  # wrapping a wrapped model's module again: that wrapper
    # a backbone unfrozen after the wrap trains in step on both ranks, and rank 0 says so once
    assert r0["unfrozen"] == pytest.approx(r1["unfrozen"], rel=1e-6, abs=1e-7)
    assert nets["output"].count("were frozen or not yet created when it was wrapped and train now") == 1
    assert "(optimizer step at " in nets["output"]
    # a parameter registered in the first forward, after the wrap: rank 0's start, then in step
    assert r0["lazy"] == pytest.approx(r1["lazy"], rel=1e-6, abs=1e-7)
    # the model's own `type` (not Module.type) and `batch_size`, set through the wrapper onto the module
    assert r0["configured"] == r1["configured"] == ["binary", "multi", 3, 3]


def test_models_kept_in_a_dict_or_a_list_are_wrapped_in_place_and_train_in_step(nets):
    r0, r1 = nets["r"]
    assert r0["containers"]["kept"] == [True, True, "kept", "tuple", 3, True]
    assert r0["containers"]["wrapped"] == [["Linear", True]] * 6  # each a DDP named after its module
    assert r0["containers"]["keys"] == ["bias", "weight"]  # plain keys, no `module.`
    for key, values in r0["containers"]["params"].items():  # each rank trained on its own batches
        assert values == pytest.approx(r1["containers"]["params"][key], rel=1e-6, abs=1e-7), key


def test_a_model_called_twice_before_one_backward_trains_in_step(nets):
    r0, r1 = nets["r"]
    assert r0["critic_mode"] == r1["critic_mode"] == "ddp"  # DDP's own reducer, after the probe step
    assert r0["critic"] == pytest.approx(r1["critic"], rel=1e-6, abs=1e-7)


def test_sparse_embedding_gradients_are_averaged_and_stay_sparse(nets):
    r0, r1 = nets["r"]
    assert r0["sparse_mode"] == r1["sparse_mode"] == "ddp"  # DDP's reducer after the probe step
    assert r0["sparse_manual_mode"] == r1["sparse_manual_mode"] == "manual"
    for key in ("sparse", "sparse_manual"):
        assert r0[key] == pytest.approx(r1[key], rel=1e-6, abs=1e-7)


def test_a_wrapped_container_averages_what_its_members_are_trained_with(nets):
    r0, r1 = nets["r"]
    assert r0["container_mode"] == r1["container_mode"] == "manual"
    assert r0["container"] == pytest.approx(r1["container"], rel=1e-6, abs=1e-7)


def test_a_summed_loss_sums_gradients_to_the_one_process_step(nets):
    for r in nets["r"]:
        assert r["summed_mode"] == "ddp"  # the probe step by hand, then DDP with the summing hook
        assert r["summed"] == pytest.approx(r["summed_reference"], rel=1e-5, abs=1e-6)


def test_a_forward_that_runs_its_own_backwards_is_averaged_like_one_process(nets):
    for r in nets["r"]:
        assert r["self_updating_mode"] == "manual"
        assert r["self_updating"] == pytest.approx(r["self_updating_reference"], rel=1e-5, abs=1e-6)
    lines = [line for line in nets["output"].splitlines() if "runs inside the forward of" in line]
    assert len(lines) == 1 and "SelfUpdating" in lines[0] and "nets.py:" in lines[0]


def test_weights_kept_as_buffers_are_averaged_and_named(nets):
    r0, r1 = nets["r"]  # (a MetaModule: DDP cannot wrap a model without parameters)
    assert r0["buffer_weights"] == pytest.approx(r1["buffer_weights"], rel=1e-6, abs=1e-7)
    assert nets["output"].count("BufferWeights keeps its 2 trainable weights as buffers") == 1


def test_a_model_trained_around_its_wrapper_is_named_once(nets):
    lines = [line for line in nets["output"].splitlines() if "before any training forward" in line]
    assert len(lines) == 1 and "Bypassed" in lines[0] and "nets.py:" in lines[0]
    assert "averaged across ranks before each optimizer step" in lines[0]
    r0, r1 = nets["r"]  # a training loop around the wrapper (a model's own fit()) still trains one model
    assert r0["bypassed"] == pytest.approx(r1["bypassed"], rel=1e-6, abs=1e-7)
    # models trained through their wrapper (every other model of the probe) are not named
    assert not any("TwoHeads" in line or "Plain" in line for line in lines)


def test_weights_used_before_the_wrappers_first_forward_are_not_written_in_place(nets):
    r0, r1 = nets["r"]  # (the probe's backward would fail: "modified by an inplace operation")
    assert r0["tabular"] == pytest.approx(r1["tabular"], rel=1e-6, abs=1e-7)


def test_a_data_dependent_init_in_the_first_forward_ends_equal_on_every_rank(nets):
    r0, r1 = nets["r"]  # (ActNorm's bias set from each rank's own first batch)
    assert r0["data_init"] == pytest.approx(r1["data_init"], rel=1e-6, abs=1e-7)


def test_a_model_fed_sparse_inputs_trains_past_the_drift_check(nets):
    r0, r1 = nets["r"]  # (the check compares the step's inputs at step 2: reshape of a sparse tensor)
    assert r0["sparse_inputs"] == pytest.approx(r1["sparse_inputs"], rel=1e-6, abs=1e-7)


def test_a_scripted_model_is_wrapped_and_trains_in_step(nets):
    r0, r1 = nets["r"]
    assert r0["scripted"] == pytest.approx(r1["scripted"], rel=1e-6, abs=1e-7)


def test_a_module_level_cleanup_in_an_imported_module_does_not_end_the_group(nets):
    assert [r["rank"] for r in nets["r"]] == [0, 1]  # set up lazily by wrap_model, kept


def test_a_pickled_wrapper_is_the_plain_module(nets):
    for r in nets["r"]:
        assert r["pickled_type"] == r["deepcopy_type"] == "Plain"


def test_the_wrapper_is_named_and_indexed_like_the_module(nets):
    for r in nets["r"]:
        assert r["type_name"] == "TwoHeads"
        assert r["sequential"] == [3, "Linear", ["Linear", "ReLU", "Linear"]]


def test_an_evaluation_from_a_thread_pool_takes_rank_0s_buffers_once(nets):
    """Threads racing into the wrapper's first no-grad forward used to broadcast the buffers once
    per thread, in a different order on each rank (gloo: data size mismatch)."""
    r0, r1 = nets["r"]
    assert r0["threaded_eval"] == r1["threaded_eval"] == 16
    assert r0["threaded_eval_buffers"] == r1["threaded_eval_buffers"]


def test_reduce_meter_leaves_a_read_only_avg_to_compute_itself(nets):
    for r in nets["r"]:
        assert r["meter"] == [6.0, 4, 1.5]


def test_reduce_meter_sums_every_metric_of_a_meter_with_one_sum_per_metric(nets):
    """`sum_rmse`, `sum_mae` beside `count`: each summed over the ranks, also after more updates."""
    for r in nets["r"]:
        assert r["result_meter"] == [6.0, 2 * 1.0 + 2 * 2.0 + 2.0, 2 * 0.5 * 2 + 2.0]


def test_the_runtime_names_a_file_every_rank_writes_and_drifting_parameters(nets):
    out = nets["output"]
    writes = [line for line in out.splitlines() if "writes" in line and "summary.txt" in line]
    assert len(writes) == 1 and "rank 1" in writes[0] and "nets_helpers.py:9" in writes[0]
    assert "rank0.json" not in out and "rank1.json" not in out  # per-rank names are intended
    drift = [line for line in out.splitlines() if "differ across ranks" in line and "Bypassed" not in line]
    assert len(drift) == 1 and "Linear" in drift[0]
    # the model trained around its wrapper has its gradients averaged before each step: no drift
    assert not any("Bypassed" in line and "differ across ranks" in line for line in out.splitlines())
    same = [line for line in out.splitlines() if "got the same inputs on every rank" in line]
    assert len(same) == 1 and "Linear" in same[0]  # the models trained on each rank's own batches: none


# ------------------------------------------------------------------ data no sampler shards

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """tests/runtime_probe/shards.py under torchrun with 2 gloo processes."""
    outdir = tmp_path_factory.mktemp("shards")
    run = torchrun("--standalone", "--nproc-per-node=2", PROBES / "shards.py", outdir,
                   env=clean_env(CUDA_VISIBLE_DEVICES=""), timeout=TIMEOUT, stale=[outdir / "*"])
    assert run.returncode == 0, run.report()
    return read_ranks(outdir, 2)


def test_shard_range_and_indices_split_disjointly_with_equal_step_counts(shards):
    r0, r1 = shards
    assert (r0["range"], r1["range"]) == ([0, 4, 8], [2, 6, 0])
    assert (r0["indices"], r1["indices"]) == ([0, 2, 4, 6], [1, 3, 5])
    assert [a or b for a, b in zip(r0["mask"], r1["mask"])] == [True, False, True, True, False, True, True]
    assert not any(a and b for a, b in zip(r0["mask"], r1["mask"]))


def test_all_rows_writes_every_ranks_rows_of_a_state_on_every_rank(shards):
    r0, r1 = shards
    assert r0["state"] == r1["state"] == [1.0, 2.0, 0.0, 0.0, 5.0, 0.0]
    assert (r0["state_no_grad"], r1["state_no_grad"]) == ([0, 1], [4])


def test_gather_rows_takes_every_ranks_keys_into_a_queue_even_without_gradients(shards):
    """A MoCo queue's enqueue runs under no_grad: every rank's keys (of uneven numbers) on every
    rank, the same rows in the same order."""
    r0, r1 = shards
    assert r0["queue_keys"] == r1["queue_keys"]
    assert sorted(row[0] for row in r0["queue_keys"]) == [0.0, 0.0, 1.0]


def test_rank_part_splits_a_batch_into_contiguous_parts(shards):
    """A batch every rank reads alike (at a cursor): each rank trains on its contiguous part, the
    parts make up the batch; a batch of fewer rows than ranks gives each rank a row, never none."""
    r0, r1 = shards
    assert (r0["parts"][0], r1["parts"][0]) == ([0, 1], [2, 3, 4])
    assert r0["parts"][1] + r1["parts"][1] == list(range(7))
    assert (r0["parts"][2], r1["parts"][2]) == ([0], [0])


def test_shard_batches_of_a_shuffling_generator_agrees_on_the_order_and_splits_it(shards):
    r0, r1 = shards
    for p in range(2):
        a, b = r0["iterator_passes"][p], r1["iterator_passes"][p]
        assert len(a) == len(b) == 3  # 5 batches: padded to 3 steps on each rank
        assert sorted(i for batch in a[:3] + b[:2] for i in batch) == list(range(9))
    assert r0["iterator_passes"][0] != r0["iterator_passes"][1]  # a new order each pass
    assert r0["own_stream_kept"] and r1["own_stream_kept"]


def test_shard_batches_of_a_plain_loader_splits_its_batches(shards):
    r0, r1 = shards
    assert len(r0["loader"]) == len(r1["loader"]) == 2
    assert sorted(i for b in r0["loader"] + r1["loader"] for i in b) == list(range(10))


def test_shard_mean_gives_the_one_process_loss_and_gradient_for_uneven_parts(shards):
    for r in shards:
        assert r["sharded_loss"] == pytest.approx(r["full_loss"], rel=1e-6)
        assert r["sharded_grads"] == pytest.approx(r["full_grads"], rel=1e-5, abs=1e-7)
        assert r["mask_loss"] == pytest.approx(r["full_loss"], rel=1e-6)
        assert r["mask_grads"] == pytest.approx(r["full_grads"], rel=1e-5, abs=1e-7)
