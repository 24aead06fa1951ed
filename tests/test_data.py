"""Every data format loads; malformed rows fail with their location or are skipped and counted;
overlong prompts are dropped and counted; the chat-template flag does what it says.

The demo tokenizer is character-level: "12+34=" -> <bos> 1 2 + 3 4 = (7 ids).
"""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from hybridrl.core.config import ConfigError, DataConfig
from hybridrl.data import prompts as data
from hybridrl.data.tasks.arithmetic import DEMO_MODEL_DIR

pytestmark = pytest.mark.fast  # starts no engine (tests/README.md)

ROWS = [{"question": "12+34=", "label": 46}, {"question": "1+2=", "label": 3}]  # int answers arrive as str


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def write(tmp_path, fmt, rows, name="d"):
    """rows (dicts; None = a missing/unparsable row where the format allows) in format fmt."""
    if fmt in ("dataset", "datasetdict"):
        import datasets

        ds = datasets.Dataset.from_list(rows)
        path = tmp_path / name
        (datasets.DatasetDict({"train": ds, "test": ds.select([0])}) if fmt == "datasetdict" else ds).save_to_disk(path)
        return path
    path = tmp_path / f"{name}.{fmt.replace('json-lines', 'json')}"
    if fmt in ("jsonl", "json-lines"):  # datasets' to_json writes JSON lines into .json files
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "csv":
        keys = list(rows[0])
        path.write_text(",".join(keys) + "\n" + "".join(",".join(str(r[k]) for k in keys) + "\n" for r in rows))
    return path


def load(path, tok, **kw):
    cfg = DataConfig(
        **{"path": str(path), "prompt_key": "question", "answer_key": "label", "chat_template": "off", **kw}
    )
    return data.encode(data.load_rows(cfg, "train"), tok, cfg, str(path))


FORMATS = ["jsonl", "json", "json-lines", "parquet", "csv", "dataset", "datasetdict"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads(tmp_path, tok, fmt):
    path = write(tmp_path, fmt, ROWS)
    prompts, dropped = load(path, tok)
    assert [(p.text, p.answer) for p in prompts] == [("12+34=", "46"), ("1+2=", "3")]
    assert prompts[0].ids == [1, 4, 5, 13, 6, 7, 14] and dropped == {"too_long": 0, "malformed": 0}


def test_saved_dataset_dict_splits(tmp_path, tok):
    path = write(tmp_path, "datasetdict", ROWS)
    cfg = DataConfig(
        path=str(path), heldout_path=str(path), prompt_key="question", answer_key="label", heldout_split="test"
    )
    assert [r.value["question"] for r in data.load_rows(cfg, "heldout")] == ["12+34="]
    assert data.load_rows(cfg, "train")[1].where == f"{path} [train] row 1"
    with pytest.raises(data.DataError, match=r"no split 'validation' \(has train, test\); set data.split"):
        data.load_rows(DataConfig(path=str(path), split="validation"), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="not one written by datasets' save_to_disk"):
        data.read_rows(str(tmp_path / "empty"))
    with pytest.raises(data.DataError, match=r"unknown format '.txt'"):
        (tmp_path / "x.txt").write_text("hi")
        data.read_rows(str(tmp_path / "x.txt"))


# A good row, then two bad ones, and where each format reports the first bad one (rows 0-based in
# tables and lists; lines 1-based in line formats, a CSV's header being line 1).
MALFORMED = {
    "jsonl": (
        '{"question": "1+1=", "label": "2"}\n{"question": oops}\n{"label": "3"}\n',
        "d.jsonl:2",
        "not valid JSON",
    ),
    "json": (
        [{"question": "1+1=", "label": "2"}, {"question": 5, "label": "5"}, ["1+1="]],
        "d.json item 1",
        "'question' must be a non-empty string, got 5",
    ),
    "parquet": (
        [{"question": "1+1=", "label": "2"}, {"question": None, "label": "5"}, {"question": "2+2=", "label": None}],
        "d.parquet row 1",
        "'question' must be a non-empty string",
    ),
    "csv": ("question,label\n1+1=,2\n2+2=,4,extra\n,5\n", "d.csv:3", "has 3 fields, the header has 2"),
    "dataset": (
        [{"question": "1+1=", "label": "2"}, {"question": None, "label": "5"}, {"question": "", "label": "0"}],
        "d row 1",
        "'question' must be a non-empty string, got None",
    ),
}


def write_malformed(tmp_path, fmt):
    content = MALFORMED[fmt][0]
    if isinstance(content, str):
        path = tmp_path / f"d.{fmt}"
        path.write_text(content)
        return path
    if fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(content))
        return path
    return write(tmp_path, fmt, content)


@pytest.mark.parametrize("fmt", list(MALFORMED))
def test_malformed_row_fails_with_its_location(tmp_path, tok, fmt):
    _, where, problem = MALFORMED[fmt]
    with pytest.raises(data.DataError) as e:
        load(write_malformed(tmp_path, fmt), tok)
    assert str(e.value).startswith(f"{tmp_path / where}: {problem}"), str(e.value)


@pytest.mark.parametrize("fmt", list(MALFORMED))
def test_malformed_rows_skipped_and_counted(tmp_path, tok, fmt, caplog):
    _, where, problem = MALFORMED[fmt]
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        prompts, dropped = load(write_malformed(tmp_path, fmt), tok, on_error="skip")
    assert [p.text for p in prompts] == ["1+1="] and dropped == {"too_long": 0, "malformed": 2}
    warnings = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, with the first location
    assert (
        f"skipped 2 of 3 malformed rows (data.on_error=skip); the first: {tmp_path / where}: {problem}" in warnings[0]
    ), warnings[0]


def test_missing_keys_name_the_knob(tmp_path, tok):
    path = write(tmp_path, "jsonl", [{"prompt": "1+1=", "label": "2"}])
    with pytest.raises(
        data.DataError,
        match=r"d.jsonl:1: no 'question' field \(has \['label', 'prompt'\]\); "
        r"set data.prompt_key",
    ):
        load(path, tok)
    path = write(tmp_path, "jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(data.DataError, match="no 'label' field .* set data.answer_key"):
        load(path, tok)
    prompts, _ = load(path, tok, answer_key="")  # no references: every answer is ''
    assert [(p.text, p.answer) for p in prompts] == [("1+1=", "")]


def test_overlong_prompts_dropped_and_counted(tmp_path, tok, caplog):
    # "12+34=" is 7 ids, "1+2=" 5: a limit of 6 drops the first
    path = write(tmp_path, "jsonl", ROWS + [{"question": "10+20=", "label": "30"}])
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        prompts, dropped = load(path, tok, max_prompt_len=6)
    assert [p.text for p in prompts] == ["1+2="] and dropped == {"too_long": 2, "malformed": 0}
    assert any("dropped 2 of 3 prompts longer than data.max_prompt_len=6" in r.getMessage() for r in caplog.records)


def test_chat_template_flag(tmp_path, tok):
    path = write(tmp_path, "jsonl", [{"question": "12+34", "label": "46"}])
    on = DataConfig(prompt_key="question", answer_key="label", chat_template="on")
    with pytest.raises(ConfigError, match="no chat template; set data.chat_template=off"):
        data.encode(data.read_rows(str(path)), tok, on, "x")  # the demo tokenizer has none
    templated = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    # the template adds the "=" a generation prompt needs: proof that it was applied
    templated.chat_template = (
        "{% for m in messages %}{{ bos_token }}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    ids = {}
    for flag in ("auto", "on", "off"):
        cfg = DataConfig(prompt_key="question", answer_key="label", chat_template=flag)
        prompts, _ = data.encode(data.read_rows(str(path)), templated, cfg, "x")
        ids[flag] = prompts[0].ids
    assert ids["auto"] == ids["on"] == [1, 4, 5, 13, 6, 7, 14]  # <bos> 1 2 + 3 4 =
    assert ids["off"] == [1, 4, 5, 13, 6, 7]  # the plain tokenizer: no "="


def test_bytes_that_are_not_utf8_name_the_file_and_line(tmp_path, tok):
    """A line saved in Latin-1 ('é' as the byte 0xe9) among UTF-8 ones: an error naming the file, the line
    and the byte, or with data.on_error=skip the row is skipped and counted. Before: a UnicodeDecodeError
    traceback naming neither. A whole JSON document cannot skip one row: it fails with its line."""
    good = json.dumps({"question": "1+1=", "label": 2}).encode()
    bad = '{"question": "caf\u00e9 1+2=", "label": 3}'.encode("latin-1")
    (tmp_path / "d.jsonl").write_bytes(b"\n".join([good, bad, good]) + b"\n")
    with pytest.raises(data.DataError) as e:
        load(tmp_path / "d.jsonl", tok)
    assert str(e.value) == (
        f"{tmp_path / 'd.jsonl'}:2: not valid UTF-8 (byte 0xe9 at character 18); save the file "
        "as UTF-8 (data.on_error=skip skips malformed rows)"
    )
    prompts, dropped = load(tmp_path / "d.jsonl", tok, on_error="skip")
    assert [p.text for p in prompts] == ["1+1=", "1+1="] and dropped["malformed"] == 1
    (tmp_path / "d.csv").write_bytes(b"question,label\n1+1=,2\ncaf\xe9,3\n")
    with pytest.raises(data.DataError, match=r"d.csv:3: not valid UTF-8 \(byte 0xe9"):
        load(tmp_path / "d.csv", tok)
    assert load(tmp_path / "d.csv", tok, on_error="skip")[1]["malformed"] == 1
    (tmp_path / "d.json").write_bytes(b'[{"question": "1+1=", "label": 2},\n {"question": "caf\xe9", "label": 3}]')
    with pytest.raises(data.DataError, match=r"d.json:2: not valid UTF-8 \(byte 0xe9 at character 19\)"):
        load(tmp_path / "d.json", tok)


@pytest.fixture(scope="module")
def chatml():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_model

    return tiny_model.tokenizer()


def test_prompts_rendered_with_the_template_are_not_templated_twice(tmp_path, chatml):
    """Data converted from verl or OpenRLHF often holds prompts already rendered with the chat template.
    Under data.chat_template=auto they were wrapped a second time without a word (two system/user
    headers); now a prompt carrying the template's markers is used as given, tokenized without added
    special tokens, and the recipe printed at start says which applied."""
    q = "what is 12+7?"
    rendered = chatml.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
    assert data.template_markers(chatml) == ["<|im_end|>", "<|im_start|>"]
    cfg = DataConfig(prompt_key="question", answer_key="label")
    plain = write(tmp_path, "jsonl", [{"question": q, "label": "19"}], "plain")
    given = write(tmp_path, "jsonl", [{"question": rendered, "label": "19"}], "given")
    wrapped = data.encode(data.read_rows(str(plain)), chatml, cfg, "x")[0][0].ids
    as_given = data.encode(data.read_rows(str(given)), chatml, cfg, "x")[0][0].ids
    assert as_given == wrapped and chatml.decode(as_given).count("<|im_start|>user") == 1
    assert data.template_choice(data.read_rows(str(plain)), chatml, cfg) == {
        "data.chat_template": ("on", "auto, the tokenizer has a chat template")
    }
    assert data.template_choice(data.read_rows(str(given)), chatml, cfg) == {
        "data.chat_template": ("as given", "auto, the prompts carry the chat template's <|im_end|> <|im_start|>")
    }
    # asking to wrap rendered prompts, or a file with both kinds: one line naming the fix
    with pytest.raises(ConfigError, match="already carry the chat template's markers .* set data.chat_template=auto"):
        data.encode(
            data.read_rows(str(given)),
            chatml,
            DataConfig(prompt_key="question", answer_key="label", chat_template="on"),
            "x",
        )
    mixed = write(tmp_path, "jsonl", [{"question": rendered, "label": "19"}, {"question": q, "label": "19"}], "mixed")
    with pytest.raises(data.DataError, match="1 of 2 prompts already carry the chat template's markers"):
        data.encode(data.read_rows(str(mixed)), chatml, cfg, "x")
    off = DataConfig(prompt_key="question", answer_key="label", chat_template="off")  # off: the text, tokenized
    assert data.encode(data.read_rows(str(given)), chatml, off, "x")[0][0].ids == chatml(rendered)["input_ids"]


@pytest.mark.parametrize(
    "row",
    [
        {"question": "<image>How many squares?", "label": "2", "images": ["a.png"]},  # verl's layout
        {"messages": [{"role": "user", "content": "How many?"}], "label": "2", "images": ["a.png"]},  # TRL's
        {"messages": [{"role": "user", "content": [{"type": "image"}]}], "label": "2"},  # an image part alone
    ],
    ids=["verl", "trl", "part"],
)
def test_a_row_with_images_for_a_text_only_model_stops_in_one_line(tmp_path, tok, row):
    """Read as text, an image column would be dropped and the model trained on '<image>' alone; the
    demo model is text-only (rows with images for a vision-language model: test_vision.py)."""
    with pytest.raises(data.DataError) as e:
        load(write(tmp_path, "jsonl", [{"question": "1+1=", "label": "2"}, row]), tok)
    assert str(e.value).startswith(f"{tmp_path / 'd.jsonl'}:2: a row with 1 image(s), but the model is text-only")
    assert "\n" not in str(e.value)
    prompts, dropped = load(write(tmp_path, "jsonl", [{"question": "1+1=", "label": "2"}, row]), tok, on_error="skip")
    assert [p.text for p in prompts] == ["1+1="] and dropped["malformed"] == 1
