"""DriveLM scoring: accuracy, language, match, an optional judge, and the weighted final score.

DriveLM-nuScenes (OpenDriveLab/DriveLM, challenge/evaluation.py) routes each QA by its `tag`:
0 -> accuracy (raw string equality), 1 -> a ChatGPT judge (0-100), 2 -> language (BLEU-1..4,
ROUGE-L, CIDEr from pycocoevalcap, corpus-level), 3 -> match (the mean of object-coordinate F1x100,
with DriveLM's greedy one-to-one |dx|+|dy| < 16 px rule, and the judge over the same items).
The final score is 0.4 judge + 0.2 language + 0.2 match + 0.2 accuracy, every part on 0..1, with
language = mean(BLEU-1..4)/3 + ROUGE-L/3 + CIDEr/30, as DriveLM's official evaluator computes it.
`score(records, judge, gate=True, renormalise=False)` reproduces the official evaluation (the PTB
tokenizer is a pure-Python copy, no Java); its defaults (gate off, missing parts' weights spread over
the others) are the older mix the synthetic benchmarks report. `litevlm.eval.score` is the official
entry point: the defaults there are the official ones.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from litevlm.errors import LiteVLMError

if TYPE_CHECKING:
    from litevlm.eval.judge import Judge

MATCH_PX = 16.0  # a predicted point matches a GT point when |dx| + |dy| < 16 (1600x900 pixels)
WEIGHTS = {"judge": 0.4, "language": 0.2, "match": 0.2, "accuracy": 0.2}  # DriveLM final score
BUCKET_TAGS = {"accuracy": 0, "judge": 1, "language": 2, "match": 3}
LANGUAGE_KEYS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr")

# ---------------------------------------------------------------------------------------------
# PTB tokenizer, pure Python.
#
# pycocoevalcap runs Stanford CoreNLP 3.4.1's PTBTokenizer (`-preserveLines -lowerCase`) through
# Java, then drops the tokens in its PUNCTUATIONS list. This is a longest-match lexer in the same
# spirit as that JFlex scanner (ties go to the earlier rule; trailing context counts towards the
# length, as in flex), covering what driving QA text contains: words, hyphen/underscore compounds,
# numbers (",1088.3,497.5" is one token, as in Java), contractions ("do n't", "it 's"),
# abbreviations and one-letter acronyms ("a." is kept unless a sentence-start word follows),
# brackets (-lrb- ... lowercased, so they survive the punctuation filter, as in Java), quotes,
# dashes and ellipses. It was checked token for token against the Java tokenizer on such text;
# rare constructs (URLs with paths, phone numbers, emoji) may differ slightly.
# ---------------------------------------------------------------------------------------------

PUNCTUATIONS = frozenset(
    ["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)

_APOS = "['\u2019]"
_ALNUM = r"[^\W_]"
_LETTER = r"[^\W\d_]"
_WORD = rf"{_LETTER}{_ALNUM}*(?:[.!?]{_LETTER}{_ALNUM}*)*"
_THING_PART = rf"(?:[dol]{_APOS}{_ALNUM})?{_ALNUM}+"
_ACRO = r"[a-z](?:\.[a-z])*"
_HYPHENATED = rf"{_THING_PART}(?:[-_\u058a\u2010\u2011]{_THING_PART})*"  # well-known, cam_front_left
_THING = rf"{_HYPHENATED}(?:/{_HYPHENATED})*"  # and high/low
_SENT_START = (
    "About According Additionally After An A As At But Did During Earlier He Her Here How However If "
    "In It Last Many More Mr. Ms. Now Once One Other Our She Since So Some Such That The Their Then "
    "There These They This We When While What Who Why Yet You"
).split()
# Capitalised first letter (case-sensitive), the rest caseless: "The" and "THE" but not "the".
_SENT_WORDS = "|".join(f"(?-i:{w[0]}){re.escape(w[1:])}" for w in sorted(_SENT_START, key=len, reverse=True))
_ABBREV = (
    # person titles and places (always abbreviations)
    r"(?:ed|ph)\.d|mrs?|ms|mx|(?-i:M)iss|drs?|profs?|sens?|reps?|attys?|lt|col|gen|messrs|govs?|adm|rev|maj|sgt|"
    r"cpl|pvt|capt|ste?|ave|pres|lieut|rt|hon|brig|co?mdr|pfc|spc|supts?|det|mt|ft|adj|adv|asst|"
    r"assoc|ens|insp|mlle|mme|msgr|sfc|sr|vs|alex|wm|jos|cie|a\.k\.a|cf|treas|ph|invt|elec|natl|"
    r"m[ft]g|dept|blvd|rd|"
    # usually followed by lower case: months, days, companies, etc.
    r"jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec|mon|tue|tues|wed|thu|thurs|fri|"
    r"inc|cos?|corp|pp?t[ye]s?|ltd|plc|bancorp|bhd|assn|univ|intl|sys|tel|est|ext|sq|jr|bros|"
    r"esq|etc|al|seq|bldg"
)

# (name, pattern, replacement). The named group "tok" (or the whole match) is the token consumed;
# the rest of the match is trailing context. A replacement of None keeps the text.
_RULES: list[tuple[str, str, str | None]] = [
    ("frac2", r"[\u00bc\u00bd\u00be\u2153\u2154]", "frac2"),
    ("cannot", r"(?P<tok>can)not", None),
    ("assim2", r"(?P<tok>gon|got|wan|lem|gim)(?:na|ta|me)(?<=gonna|gotta|wanna|lemme|gimme)", None),
    ("tis", rf"(?P<tok>{_APOS}t)(?:is|was)\b", "'t"),
    (
        "sgml",
        r"</?[a-z][a-z0-9_:.\-]*(?:\s+[a-z][a-z0-9_:.\-]*(?:\s*=\s*(?:'[^']*'|\"[^\"]*\"|[a-z][a-z0-9_:.\-]*))?)*\s*/?>",
        "sgml",
    ),
    ("word_redaux", rf"(?P<tok>{_WORD}){_APOS}(?:[msd]|re|ve|ll)", None),
    ("sword_sredaux", rf"(?P<tok>{_LETTER}*[a-mo-z])n{_APOS}t", None),
    ("word", _WORD, None),
    (
        "apoword",
        rf"{_APOS}n{_APOS}|[ldj]{_APOS}|{_APOS}em|{_APOS}[2-9]0s|{_APOS}till?|{_APOS}cause|"
        rf"[a-hj-xzn]{_APOS}{_LETTER}{{2,}}",
        "apos",
    ),
    ("url", r"(?:https?|ftp|mailto)://[^\s\"<>|(){}\[\]]*[^\s\"'<>|.!?(){},;:&\[\]-]", None),
    ("www", r"www\.(?:[^\s\"<>|.!?(){},/]+\.)+[a-z]{2,4}", None),
    ("email", r"[a-z0-9._%+-]+@[a-z0-9][a-z0-9.-]*[a-z0-9]", None),
    ("twitter", r"@[a-z_][a-z_0-9]*|#[a-z][a-z0-9]*", None),
    ("redaux", rf"(?P<tok>{_APOS}(?:[msd]|re|ve|ll))(?:[\W\d_]|$)", "apos"),
    ("sredaux", rf"(?P<tok>n{_APOS}t)(?:[\W\d_]|$)", "apos"),
    ("number", r"[-+]?\d*(?:[.:,\u00ad\u066b\u066c]\d+)+|[-+]?\d+", None),
    ("frac", r"(?:\d{1,4}[- \u00a0])?\d{1,4}/\d{1,4}", "nbsp"),
    # One-letter acronym before a sentence-start word: the period ends the sentence ("C. The").
    ("acronym_end", rf"(?P<tok>{_ACRO}\.)\s+(?:{_SENT_WORDS})(?:\s|[?!]|$)", "acronym_end"),
    ("abbrev3", r"(?P<tok>(?:ca|figs?|prop|nos?|sect?s?|arts?|paras?|bldg|pp|op)\.)\s?\d", None),
    ("abbrev", rf"(?:{_ABBREV}|{_ACRO})\.", None),
    ("word_period", rf"(?P<tok>(?:{_WORD}|{_THING})\.)[,;:]", None),
    ("dblquote", r"\"|&quot;|[`'\u2018\u2019]'", "''"),
    ("duckfeet", r"<<|>>", None),
    ("lt", r"<|&lt;", "<"),
    ("gt", r">|&gt;", ">"),
    ("smiley", r"(?P<tok>[<>]?[:;=][\-o*']?[()DPdpO\\{@|\[\]])(?:[^\w]|_|$)", "brackets"),
    ("lcb", r"\{", "-LCB-"),
    ("rcb", r"\}", "-RCB-"),
    ("lsb", r"\[", "-LSB-"),
    ("rsb", r"\]", "-RSB-"),
    ("lrb", r"\(", "-LRB-"),
    ("rrb", r"\)", "-RRB-"),
    ("dash", r"&(?:m|n)dash;|[\u2012-\u2015]", "--"),
    ("hyphens", r"-+", "hyphens"),
    ("ldots", r"\.\.\.+|[\u0085\u2026]", "..."),
    ("fnmarks", r"@+|#+|_+", None),
    ("asts", r"\*+", None),
    ("insentp", r"[,;:\u3001]", None),
    ("bang", r"[?!]+", None),
    ("period", r"[.\u00a1\u00bf]", None),
    ("equals", r"=+", None),
    ("quotes", rf"{_APOS}|[`\u2018-\u201f\u2039\u203a\u00ab\u00bb]{{1,2}}", "''"),
    ("thing", _THING, "apos"),
    ("other", r"\S", None),
]
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE), repl) for name, pattern, repl in _RULES]
_SPACE = re.compile(r"\s+")
_FRACTIONS = {"\u00bc": "1/4", "\u00bd": "1/2", "\u00be": "3/4", "\u2153": "1/3", "\u2154": "2/3"}


def _normalise_token(text: str, repl: str | None) -> str:
    if repl is None:
        return text
    if repl == "apos":
        return text.replace("\u2019", "'")
    if repl in ("sgml", "nbsp"):
        return re.sub(r"[ \r\n]", "\u00a0", text)
    if repl == "frac2":
        return _FRACTIONS[text]
    if repl == "acronym_end":  # one letter gives back its period; "U.S." keeps it (Java adds a "." after)
        return text[:-1] if len(text) == 2 else text
    if repl == "brackets":
        return text.replace("(", "-LRB-").replace(")", "-RRB-")
    if repl == "hyphens":
        return "--" if 3 <= len(text) <= 4 else text
    return repl


def ptb_tokenize(text: str) -> str:
    """Tokenise like pycocoevalcap's PTBTokenizer: lowercase, PTB tokens, punctuation tokens dropped.

    Returns the tokens joined by single spaces (what the pycocoevalcap scorers expect).
    """
    text = text.replace("\n", " ")
    tokens = []
    pos, end = 0, len(text)
    while True:
        space = _SPACE.match(text, pos)
        if space:
            pos = space.end()
        if pos >= end:
            break
        best = None  # (full match length, token text, consumed length)
        for _, pattern, repl in _COMPILED:
            m = pattern.match(text, pos)
            if m is None or m.end() == pos:
                continue
            tok = m.group("tok") if "tok" in pattern.groupindex else m.group(0)
            if best is None or m.end() - pos > best[0]:
                best = (m.end() - pos, _normalise_token(tok, repl), len(tok))
        tokens.append(best[1])
        pos += best[2]
    return " ".join(t for t in (t.lower() for t in tokens) if t not in PUNCTUATIONS)


# ---------------------------------------------------------------------------------------------
# Language score
# ---------------------------------------------------------------------------------------------


def language_scorers() -> tuple[type, type, type]:
    """pycocoevalcap's Bleu, Rouge and Cider classes, imported here so that only the language score needs the
    package; LiteVLMError saying how to install it when it is absent."""
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError as e:
        raise LiteVLMError(
            f"DriveLM's language score (BLEU, ROUGE-L, CIDEr) needs pycocoevalcap ({e}): "
            "pip install 'pycocoevalcap==1.2' (a dependency of litevlm: pip install litevlm brings it)"
        ) from None
    return Bleu, Rouge, Cider


def language_scores(predictions: Sequence[str], references: Sequence[str]) -> dict:
    """BLEU-1..4, ROUGE-L and CIDEr(-D) of predictions against one reference each, corpus-level.

    The pycocoevalcap scorers on gts={i: [ref_i]}, res={i: [pred_i]}, both PTB-tokenised (pure
    Python, see `ptb_tokenize`). CIDEr's IDF comes from these references, so it depends on the
    corpus: an answer identical to its reference scores 10 only when the corpus has several
    distinct references (a one-item corpus always gets CIDEr 0). An empty prediction scores 0.
    """
    if len(predictions) != len(references):
        raise LiteVLMError(
            f"language_scores got {len(predictions)} predictions but {len(references)} references; "
            "pass one reference per prediction"
        )
    if not predictions:
        raise LiteVLMError("language_scores needs at least one prediction/reference pair")
    Bleu, Rouge, Cider = language_scorers()
    gts = {i: [ptb_tokenize(ref)] for i, ref in enumerate(references)}
    res = {i: [ptb_tokenize(pred)] for i, pred in enumerate(predictions)}
    # pycocoevalcap's Bleu prints its counts to stdout; our CLI's last stdout line must be JSON.
    with contextlib.redirect_stdout(io.StringIO()):
        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        rouge, _ = Rouge().compute_score(gts, res)
        if any(ref[0] for ref in gts.values()):
            cider, _ = Cider().compute_score(gts, res)
        else:  # every reference is empty: no n-gram statistics (the scorer would fail on max([]))
            cider = 0.0
    values = [*bleu, rouge, cider]
    return {key: float(value) for key, value in zip(LANGUAGE_KEYS, values)}


def language_score(scores: dict) -> float:
    """DriveLM's combined language score: mean(BLEU-1..4)/3 + ROUGE-L/3 + CIDEr/30 (0..1)."""
    bleu = sum(scores[f"Bleu_{n}"] for n in range(1, 5)) / 4.0
    return bleu / 3.0 + scores["ROUGE_L"] / 3.0 + scores["CIDEr"] / 30.0


# ---------------------------------------------------------------------------------------------
# Match score (object coordinates)
# ---------------------------------------------------------------------------------------------

_DECIMAL = re.compile(r"\d+\.\d+")


def extract_points(text: str) -> list[tuple[float, float]]:
    """The (x, y) points DriveLM reads from a text: every `\\d+\\.\\d+`, paired in order.

    Camera names, c-ids and integers ("1088") are ignored; any other decimal ("2.5 m") counts.
    An odd count drops the last number (DriveLM trims predictions; for a GT it would crash).
    """
    numbers = [float(x) for x in _DECIMAL.findall(text)]
    if len(numbers) % 2:
        numbers = numbers[:-1]
    return list(zip(numbers[0::2], numbers[1::2]))


def match_points(pred: str, gt: str) -> tuple[float, list[tuple[float, float]]]:
    """F1 (0..1) of the predicted points against the GT points, and the GT points matched.

    Greedy in prediction order: each predicted point takes the nearest remaining GT point by
    |dx| + |dy| (the first one on a tie) if that distance is < 16 px, else it is a false positive.
    The 1e-8 guards are DriveLM's, so a perfect answer scores 1 - ~2e-8 and no points score 0.
    """
    remaining = extract_points(gt)
    n_gt = len(remaining)
    matched = []
    tp = fp = 0
    for px, py in extract_points(pred):
        best_i, best_d = None, float("inf")
        for i, (gx, gy) in enumerate(remaining):
            d = abs(px - gx) + abs(py - gy)
            if d < best_d:
                best_i, best_d = i, d
        if best_d < MATCH_PX:
            tp += 1
            matched.append(remaining.pop(best_i))
        else:
            fp += 1
    fn = n_gt - tp
    precision = tp / (tp + fp + 1e-8)
    recall = tp / (tp + fn + 1e-8)
    return 2 * precision * recall / (precision + recall + 1e-8), matched


def match_f1(pred: str, gt: str) -> float:
    """DriveLM's coordinate F1 (0..1) of one answer; see `match_points`."""
    return match_points(pred, gt)[0]


# ---------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------


def normalize_answer(text: str) -> str:
    """Lowercase, collapse whitespace, drop trailing periods: "  Yes. " -> "yes"."""
    return " ".join(text.split()).lower().rstrip(". ")


def answered_right(record: dict) -> bool:
    """A record's answer equals its reference after `normalize_answer` (how a closed question is scored)."""
    return normalize_answer(record["answer"]) == normalize_answer(record["gt"])


def closed_accuracy(records: Iterable[dict]) -> float | None:
    """Accuracy (0..1) over the records flagged `closed=True`, exact match after `normalize_answer`.

    The headline "closed-question accuracy"; None when no record is closed.
    """
    hits = [answered_right(r) for r in records if r.get("closed")]
    return sum(hits) / len(hits) if hits else None


# ---------------------------------------------------------------------------------------------
# Final score
# ---------------------------------------------------------------------------------------------


def final_weights(present: Iterable[str]) -> dict[str, float]:
    """DriveLM's weights restricted to the present buckets and rescaled to sum to 1."""
    present = set(present)
    present = [name for name in WEIGHTS if name in present]
    total = sum(WEIGHTS[name] for name in present)
    return {name: WEIGHTS[name] / total for name in present}


def final_score(
    accuracy: float | None, judge: float | None, language: float | None, match: float | None
) -> float | None:
    """DriveLM's final score, every component on 0..1: 0.4 judge + 0.2 (language + match + accuracy).

    A component given as None is left out and the other weights are rescaled to sum to 1
    (no judge: a third each). None when every component is None.
    """
    parts = {"judge": judge, "language": language, "match": match, "accuracy": accuracy}
    weights = final_weights(name for name, value in parts.items() if value is not None)
    if not weights:
        return None
    return sum(weight * parts[name] for name, weight in weights.items())


# ---------------------------------------------------------------------------------------------
# Scoring a set of answered questions
# ---------------------------------------------------------------------------------------------


def _tags(record: dict, where: str) -> set[int]:
    tag = record["tag"]
    tags = [tag] if isinstance(tag, int) and not isinstance(tag, bool) else tag
    if not isinstance(tags, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t in BUCKET_TAGS.values() for t in tags
    ):
        raise LiteVLMError(f"{where}: tag must be 0, 1, 2, 3 or a list of them (DriveLM routing), got {tag!r}")
    return set(tags)


def _check(records: Sequence[dict], gate: bool) -> None:
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise LiteVLMError(f"record {i}: expected a dict, got {type(record).__name__}")
        where = f"record {i} (id {record.get('id')!r})"
        missing = [key for key in ("id", "question", "answer", "gt", "tag") if key not in record]
        if gate and "frame" not in record:
            missing.append("frame")
        if missing:
            raise LiteVLMError(
                f"{where}: missing {', '.join(missing)}" + (" (gate=True needs a frame id)" if gate else "")
            )
        for key in ("question", "answer", "gt"):
            if not isinstance(record[key], str):
                raise LiteVLMError(f"{where}: {key} must be a string, got {type(record[key]).__name__}")
        _tags(record, where)


def apply_gate(records: Sequence[dict]) -> list[dict]:
    """DriveLM's graph gate (the official evaluator's), per frame, records in order.

    The first record of each frame is always kept; the GT points its answer matched (< 16 px)
    become the frame's graph. A later record is kept only if every (x, y) pair in its question is
    in that graph; a question without decimals always passes.
    """
    graphs: dict = {}
    kept = []
    for record in records:
        frame = record["frame"]
        if frame not in graphs:
            graphs[frame] = match_points(record["answer"], record["gt"])[1]
            kept.append(record)
        # DriveLM would crash on an odd count of decimals in a question; extract_points drops the last
        elif all(point in graphs[frame] for point in extract_points(record["question"])):
            kept.append(record)
    return kept


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def score(records: Sequence[dict], judge: Judge | None = None, gate: bool = False, renormalise: bool = True) -> dict:
    """DriveLM scores of answered questions.

    Each record is a dict with `id`, `question`, `answer` (the prediction), `gt`, `tag` (0, 1, 2,
    3 or a list of them) and, for the gate, `frame`; `closed=True` marks closed questions for
    `closed_accuracy`. `judge` is a `litevlm.eval.judge.Judge` (or anything with
    `.score(question, gt, pred) -> float | None` on 0..100).

    gate=False by default (the synthetic benchmarks score every record): the official evaluator's
    graph gate, gate=True, drops every later question of a frame about an object whose coordinates
    the frame's first answer missed (records need a `frame`; each frame's first record in order
    opens its graph).

    renormalise=True by default: a part that cannot be computed (no judge, a bucket without items)
    has its weight spread over the others. renormalise=False keeps the official weights and counts
    such a part as 0, as the official formula would (no judge: its 0.4 and the judge half of match);
    with a judge and every bucket filled both give the official final.

    Returned (buckets with no items are None):
      n, n_scored, gated_out, counts (records per bucket, after the gate, and closed ones),
      accuracy (raw string equality, as DriveLM), accuracy_normalized (case, whitespace and
      trailing period ignored), closed_accuracy, language (combined, 0..1), language_detail
      (Bleu_1..4, ROUGE_L, CIDEr), match (0..1: DriveLM's (mean F1x100 + judge)/2/100 with a
      judge, mean F1 alone without), match_f1, match_judge, match_note, judge (mean over tag-1
      items / 100), judge_model, judge_unparsed (judge replies without a number, left out of the
      means), final, final_note, weights (the weights actually used), missing (the parts counted
      as 0 when renormalise=False).
    """
    records = list(records)
    _check(records, gate)
    scored = apply_gate(records) if gate else records

    buckets: dict[str, list[dict]] = {name: [] for name in BUCKET_TAGS}
    for record in scored:
        tags = _tags(record, "")
        for name, tag in BUCKET_TAGS.items():
            if tag in tags:
                buckets[name].append(record)

    unparsed = 0

    def judged(items: list[dict]) -> list[float]:
        nonlocal unparsed
        values = []
        for r in items:
            value = judge.score(r["question"], r["gt"], r["answer"])
            if value is None:
                unparsed += 1
            else:
                values.append(float(value))
        return values

    acc_items = buckets["accuracy"]
    accuracy = _mean([float(r["answer"] == r["gt"]) for r in acc_items])
    accuracy_normalized = _mean([float(normalize_answer(r["answer"]) == normalize_answer(r["gt"])) for r in acc_items])

    language_detail = None
    language = None
    if buckets["language"]:
        language_detail = language_scores(
            [r["answer"] for r in buckets["language"]], [r["gt"] for r in buckets["language"]]
        )
        language = language_score(language_detail)

    judge_score = None
    if judge is not None and buckets["judge"]:
        mean = _mean(judged(buckets["judge"]))
        judge_score = None if mean is None else mean / 100.0

    match = match_f1_mean = match_judge = None
    match_note = "no match items (tag 3)"
    if buckets["match"]:
        match_f1_mean = _mean([match_f1(r["answer"], r["gt"]) for r in buckets["match"]])
        if judge is not None:
            mean = _mean(judged(buckets["match"]))
            match_judge = None if mean is None else mean / 100.0
        if match_judge is not None:
            match = (match_f1_mean * 100.0 + match_judge * 100.0) / 2.0 / 100.0
            match_note = "DriveLM: (mean coordinate F1 x 100 + judge over the same items) / 2, on 0..1"
        elif judge is None:
            match = match_f1_mean
            match_note = "no judge: match is the mean coordinate F1 alone"
        else:
            match = match_f1_mean
            match_note = "judge gave no parseable score on the match items: match is the mean coordinate F1 alone"

    if not renormalise and judge is None and match_f1_mean is not None:
        match = match_f1_mean / 2.0  # (F1 x 100 + judge, counted as 0) / 2 / 100
        match_note = "no judge: match is (mean coordinate F1 x 100 + 0) / 2, the judge half counted as 0"

    parts = {"judge": judge_score, "language": language, "match": match, "accuracy": accuracy}
    missing = [name for name, value in parts.items() if value is None]
    if renormalise:
        final = final_score(accuracy, judge_score, language, match)
        weights = final_weights(name for name, value in parts.items() if value is not None)
    else:
        final = sum(WEIGHTS[name] * (parts[name] or 0.0) for name in WEIGHTS) if len(missing) < len(parts) else None
        weights = dict(WEIGHTS)
    notes = []
    spread = "weight renormalised away" if renormalise else "counted as 0"
    if judge is None:
        others = [name for name in ("language", "match", "accuracy") if parts[name] is not None]
        if renormalise:
            notes.append("no judge: weights renormalised over " + ", ".join(others) if others else "no judge")
        else:
            notes.append("no judge: the judge's 0.4 and the judge half of match counted as 0")
    elif not buckets["judge"]:
        notes.append(f"no judge items (tag 1): judge {spread}")
    elif judge_score is None:
        notes.append(f"judge gave no parseable score: judge {spread}")
    if judge is not None and unparsed:
        notes.append(f"{unparsed} judge replies without a number left out of the judge means")
    for name in ("language", "match", "accuracy"):
        if not buckets[name]:
            notes.append(f"no {name} items (tag {BUCKET_TAGS[name]}): {name} {spread}")
    if final is None:
        notes.append("nothing to score")
    elif not notes:
        notes.append("DriveLM weights: 0.4 judge + 0.2 language + 0.2 match + 0.2 accuracy")
    if gate:
        notes.append(f"graph gate on: {len(records) - len(scored)} of {len(records)} records dropped")

    counts = {name: len(items) for name, items in buckets.items()}
    counts["closed"] = sum(1 for r in records if r.get("closed"))
    return {
        "n": len(records),
        "n_scored": len(scored),
        "gated_out": len(records) - len(scored),
        "counts": counts,
        "accuracy": accuracy,
        "accuracy_normalized": accuracy_normalized,
        "closed_accuracy": closed_accuracy(records),
        "language": language,
        "language_detail": language_detail,
        "match": match,
        "match_f1": match_f1_mean,
        "match_judge": match_judge,
        "match_note": match_note,
        "judge": judge_score,
        "judge_model": getattr(judge, "model", None) if judge is not None else None,
        "judge_unparsed": unparsed,
        "final": final,
        "final_note": "; ".join(notes),
        "weights": weights,
        "missing": [] if renormalise else missing,
    }
