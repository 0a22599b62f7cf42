"""A model moved in chunks: converted, saved, cut, joined elsewhere and loaded gives the same
logits; a missing, corrupt or foreign chunk is named."""

import json
import os
import shutil
import subprocess

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import kvfn_models
from kvfn_models import ship
from kvfn_models.ship import ShipError

QUESTION = "What is the capital of France?"


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.fixture(scope="module")
def prompt(smollm2):
    _, tokenizer = smollm2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                        add_generation_prompt=True)  # fmt: skip
    return mx.array([ids])


# bf16: the whole prompt; 4-bit: its first 3 tokens (MLX's CPU quantized matmuls in bf16 take
# about a second a token here). Limits that cut each folder into several chunks.
@pytest.mark.parametrize("bits, tokens, limit", [(None, None, 40 << 20), (4, 3, 20 << 20)])
def test_a_chunked_model_joins_and_loads_with_the_same_logits(smollm2, prompt, tmp_path, bits,
                                                              tokens, limit):  # fmt: skip
    model, tokenizer = smollm2
    x = prompt[:, :tokens]
    converted = ship.convert(model, bits=bits)
    assert next(iter(model.parameters()["model"]["norm"].values())).dtype == mx.float32  # untouched
    expected = converted(x)
    folder = ship.save(converted, tokenizer, tmp_path / "model")
    size = _dir_bytes(folder)
    dirs = ship.chunk(folder, tmp_path / "here", limit=limit)
    assert len(dirs) == -(-size // (limit - ship.MANIFEST_ROOM)) >= 3
    assert [d.name for d in dirs] == [f"c{i:03d}" for i in range(1, len(dirs) + 1)]
    assert all(_dir_bytes(d) <= limit for d in dirs)

    stage = tmp_path / "there"  # as on the GPU machine: each chunk brought over on its own
    stage.mkdir()
    for d in dirs:
        shutil.move(d, stage / d.name)
    shutil.rmtree(folder)
    joined = ship.join(stage, tmp_path / "joined")
    loaded, loaded_tokenizer = kvfn_models.load(joined)
    got = loaded(x)
    assert got.dtype == expected.dtype == mx.bfloat16
    assert mx.array_equal(got, expected).item()  # the same weights and graph: bit for bit
    assert loaded_tokenizer.eos_token_ids == tokenizer.eos_token_ids
    messages = [{"role": "user", "content": QUESTION}]
    assert loaded_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )
    config = json.loads((joined / "config.json").read_text())
    if bits:
        assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
        return
    assert "quantization" not in config
    # bf16 against the float32 original: bf16 keeps 8 significant bits, so every weight and
    # every activation of the 30 layers is rounded by up to 2^-9 (0.2%) relative; those errors
    # add up to a few % of the logits' spread (measured: mean 2.2% of their std, max 3.5% of the
    # largest logit). Twice that is allowed; a wrong weight layout, RoPE or norm misses by far
    # more. The greedy token after the prompt must agree.
    reference = model(x)
    diff = mx.abs(got.astype(mx.float32) - reference)
    assert diff.mean().item() < 0.05 * reference.std().item()
    assert diff.max().item() < 0.1 * mx.abs(reference).max().item()
    assert mx.argmax(got[0, -1]).item() == mx.argmax(reference[0, -1]).item()


def test_a_quantized_model_converts_as_its_dequantized_load(smollm2):
    # MLX-quantized GGUF blocks (the GPU's default load) are dequantized in float32 before the
    # cast, as the CPU's default load dequantizes them: the same bf16 weights
    quantized, _ = kvfn_models.load(dequantize=False)
    assert isinstance(quantized.model.layers[0].mlp.up_proj, nn.QuantizedLinear)
    got = dict(tree_flatten(ship.convert(quantized).parameters()))
    want = dict(tree_flatten(smollm2[0].parameters()))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == mx.bfloat16
        assert mx.array_equal(got[name], value.astype(mx.bfloat16)).item(), name


@pytest.fixture
def chunks(tmp_path):
    """A folder of 3 files (one empty) cut into chunks of 160 KiB (96 KiB of pieces each)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "a.bin").write_bytes(os.urandom(300_000))
    (folder / "b.json").write_bytes(b"")
    (folder / "c.bin").write_bytes(os.urandom(150_000))
    dirs = ship.chunk(folder, tmp_path / "stage", limit=160 << 10)
    return folder, tmp_path / "stage", dirs


def test_chunks_hold_pieces_in_order_and_join_byte_for_byte(chunks, tmp_path):
    folder, stage, dirs = chunks
    assert len(dirs) == 5  # 450,000 bytes in pieces of at most 98,304
    manifest = ship.read_manifest(stage)
    assert [f["name"] for f in manifest["files"]] == ["a.bin", "b.json", "c.bin"]
    assert [c["dir"] for c in manifest["chunks"]] == [d.name for d in dirs]
    joined = ship.join(stage, tmp_path / "joined")
    for f in folder.iterdir():
        assert (joined / f.name).read_bytes() == f.read_bytes()


def test_a_missing_chunk_is_named(chunks, tmp_path):
    _, stage, dirs = chunks
    shutil.rmtree(dirs[1])
    shutil.rmtree(dirs[3])
    with pytest.raises(ShipError, match="comes in 5 chunks; missing under .*: c002, c004$"):
        ship.join(stage, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()


def test_a_missing_piece_is_named(chunks, tmp_path):
    _, stage, dirs = chunks
    next(p for p in dirs[2].iterdir() if p.name != ship.MANIFEST).unlink()
    with pytest.raises(ShipError, match=r"missing under .*: c003 \(its [a-z.]+\.\d{3}\)"):
        ship.join(stage, tmp_path / "joined")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_chunk_is_named_and_nothing_is_left(chunks, tmp_path, damage):
    _, stage, dirs = chunks
    piece = next(p for p in sorted(dirs[3].iterdir()) if p.name != ship.MANIFEST)
    data = bytearray(piece.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 1
    else:
        del data[-1]
    piece.write_bytes(bytes(data))
    got = f"{len(data)} bytes" if damage == "truncate" else "sha256 "
    with pytest.raises(ShipError, match=f"chunk c004 is corrupt: {piece.name} has {got}"):
        ship.join(stage, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_chunk_of_another_shipment_is_named(chunks, tmp_path):
    folder, stage, dirs = chunks
    (folder / "c.bin").write_bytes(os.urandom(150_000))
    other = ship.chunk(folder, tmp_path / "other", limit=160 << 10)
    shutil.rmtree(dirs[4])
    shutil.copytree(other[4], dirs[4])
    with pytest.raises(ShipError, match="chunk c005's manifest differs from c001's"):
        ship.join(stage, tmp_path / "joined")


def test_bad_input_is_named(smollm2, chunks, tmp_path):
    model, tokenizer = smollm2
    with pytest.raises(ValueError, match="bits=7 is not supported"):
        ship.convert(model, bits=7)
    with pytest.raises(ValueError, match="dtype=mlx.core.int32 is not a floating-point type"):
        ship.convert(model, dtype=mx.int32)
    folder, stage, _ = chunks
    with pytest.raises(ValueError, match="limit=1000 bytes is too small"):
        ship.chunk(folder, tmp_path / "x", limit=1000)
    with pytest.raises(FileExistsError, match="already holds chunks"):
        ship.chunk(folder, stage)
    with pytest.raises(FileExistsError, match="is not empty"):
        ship.save(model, tokenizer, folder)
    with pytest.raises(ShipError, match="no chunk"):
        ship.join(tmp_path / "nowhere", tmp_path / "joined")


def test_the_example_joins_and_names_what_is_wrong(chunks, tmp_path, capsys):
    from examples import ship_model

    folder, stage, dirs = chunks
    ship_model.main(["--join", str(stage), "--out", str(tmp_path / "joined"), "--no-check"])
    assert f"joined {tmp_path / 'joined'}" in capsys.readouterr().out
    assert (tmp_path / "joined" / "a.bin").read_bytes() == (folder / "a.bin").read_bytes()
    shutil.rmtree(dirs[0])
    with pytest.raises(SystemExit, match="error: .* missing under .*: c001$"):
        ship_model.main(["--join", str(stage), "--out", str(tmp_path / "again"), "--no-check"])
    with pytest.raises(SystemExit):
        ship_model.main(["--join", str(stage)])
    assert "--join STAGE takes --out FOLDER and no model" in capsys.readouterr().err


def test_a_gguf_ships_as_it_is_and_the_check_loads_it(tmp_path, capsys):
    """--as-is cuts the GGUF file itself; joined, it is the same bytes, and the join's check
    loads it (the embedded SmolLM2) and answers."""
    from examples import ship_model

    gguf = kvfn_models.embedded_model_path()
    out = tmp_path / "stage"
    ship_model.main([str(gguf), "--as-is", "--limit-mib", "40", "--out", str(out)])
    said = capsys.readouterr().out
    assert f"{gguf.stem}-gguf:" in said and "in 3 chunks" in said  # 98 MB in 40 MiB chunks
    assert not (out / "model").exists()  # the link to the file is gone; the file is not
    assert gguf.is_file()
    ship_model.main(["--join", str(out), "--out", str(tmp_path / "joined")])
    joined = tmp_path / "joined" / gguf.name
    assert joined.read_bytes() == gguf.read_bytes()
    assert "Paris" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ship_model.main([str(gguf), "--as-is", "--bits", "4", "--out", str(tmp_path / "x")])
    assert "--as-is ships the GGUF unchanged: it takes no --bits" in capsys.readouterr().err
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(SystemExit, match="--as-is ships a GGUF file; .* is not one"):
        ship_model.main([str(folder), "--as-is", "--out", str(tmp_path / "y")])


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_default_chunk_leaves_room_for_the_tree_that_travels(tmp_path):
    """A chunk and the working tree travel in one 64 MiB call: the default limit is what the
    tree's tracked and unignored files leave; ignored files do not count."""
    from examples import ship_model

    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / ".gitignore").write_text("/.ship/\n")
    (repo / "tracked.bin").write_bytes(b"x" * (3 << 20))
    (repo / ".ship").mkdir()
    (repo / ".ship" / "c001").write_bytes(b"x" * (40 << 20))  # ignored: not counted
    subprocess.run(["git", "add", "tracked.bin"], cwd=repo, check=True)
    (repo / "untracked.bin").write_bytes(b"x" * (2 << 20))  # sent too
    tree = ship_model.travelling_bytes(repo)
    assert tree == (5 << 20) + len("/.ship/\n")
    assert ship_model.default_limit(repo) == ship_model.CALL_LIMIT - tree - ship_model.MARGIN
    assert ship_model.travelling_bytes(tmp_path) is None  # not a git checkout
    (repo / "big.bin").write_bytes(b"x" * (56 << 20))
    with pytest.raises(ValueError, match=r"sends 61\.0 MiB with every device call"):
        ship_model.default_limit(repo)
