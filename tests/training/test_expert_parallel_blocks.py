"""Expert parallelism shards every routed block: the shipped MSIT and MoEP-paths recipes (tiny shapes, built-in
corpus) train on 2 processes under ZeRO-2 fp32 with expert_parallel_size 2 exactly like expert_parallel_size 1,
and an expert-parallel checkpoint of their stacked experts resumes at expert_parallel_size 1."""
import pytest

from tiny import DS_CONFIGS, REPO, losses, run_jobs

pytestmark = pytest.mark.slow
COMMON = [  # tiny shapes on the built-in corpus, 5 logged steps, no checkpoints
    "data.source=builtin", "data.tokenizer.vocab_size=512", "model.vocab_size=512", "model.max_seq_len=32",
    "data.seq_len=32", "train.max_steps=5", "train.log_every=1", "train.micro_batch_size=4",
    "train.global_batch_size=8", "train.checkpoint.every_steps=3", "train.checkpoint.at_end=false",
    "train.eval_every=null",
]
RECIPES = {
    "quickstart": ["model.d_model=32", "model.layers[0].attention.num_heads=2", "model.layers[0].experts.d_thin=32",
                   "model.layers[0].experts.num_heads=2"],
    "moep_gpt2": ["model.d_model=32", "model.layers[0].attention.num_heads=2", "model.layers[0].d_path=16",
                  "model.layers[0].path_depth=2", "model.layers[0].path_ffn.hidden_size=24"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_blocks")
    jobs, out = [], {}
    for name, shape in RECIPES.items():
        for ep in (1, 2):
            out[name, ep] = tmp / f"{name}_ep{ep}"
            sets = [*COMMON, *shape, f"train.output_dir={out[name, ep]}", f"train.expert_parallel_size={ep}"]
            jobs.append({"recipe": str(REPO / "configs" / f"{name}.yaml"), "overrides": sets,
                         "ds_config": str(DS_CONFIGS / "zero2_fp32.json")})
        out[name, "resumed"] = tmp / f"{name}_ep2_resumed_at_ep1"
        sets = [*COMMON, *shape, f"train.output_dir={out[name, 'resumed']}", "train.expert_parallel_size=1"]
        jobs.append({"recipe": str(REPO / "configs" / f"{name}.yaml"), "overrides": sets,
                     "ds_config": str(DS_CONFIGS / "zero2_fp32.json"),
                     "resume": str(out[name, 2] / "checkpoints" / "step_00000003")})
    run_jobs(2, jobs)
    return out


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_first_five_losses_equal_at_expert_parallel_1_and_2(runs, name):
    ep1, ep2 = losses(runs[name, 1]), losses(runs[name, 2])
    assert sorted(ep1) == sorted(ep2) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert ep2[step] == pytest.approx(ep1[step], rel=1e-4), (name, step, ep1, ep2)
    assert ep1[5] != ep1[1]  # it trained


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_expert_parallel_checkpoint_resumes_at_expert_parallel_1(runs, name):
    ep2, resumed = losses(runs[name, 2]), losses(runs[name, "resumed"])
    assert sorted(resumed) == [4, 5]
    for step in (4, 5):
        assert resumed[step] == pytest.approx(ep2[step], rel=1e-4), (name, step, ep2, resumed)
