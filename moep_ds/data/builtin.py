"""The embedded default corpus: a small probabilistic English grammar written for this project.

It needs no download and copies no third-party text. Stories of 3-8 sentences exercise agreement that a
language model has to learn:
  short distance   determiner-noun (this dog / these dogs), subject-verb (the dog sleeps / the dogs sleep)
  long distance    subject-verb across a prepositional phrase or relative clause with an attractor noun
                   (the key near the boxes is red), reflexives (the girls near the boy see themselves),
                   pronouns agreeing with a character introduced sentences earlier (Anna ... She ... her)
`minimal_pairs(n, seed)` emits BLiMP-style pairs (one agreement flipped) from the same grammar, and
`pairs_per_phenomenon(n, seed)` n distinct pairs of each phenomenon for the `grammar_pairs` evaluation task.
Everything is deterministic from the seed (`random.Random`).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

CORPUS_VERSION = 1  # bump when the grammar changes, so cached corpora are regenerated


@dataclass(frozen=True)
class Noun:
    sg: str
    pl: str
    kind: str  # "m" / "f": gendered person, "p": person of either gender, "a": animal, "t": thing

    @property
    def animate(self) -> bool:
        return self.kind != "t"

    def form(self, plural: bool) -> str:
        return self.pl if plural else self.sg


@dataclass(frozen=True)
class Verb:
    s3: str  # third person singular present
    base: str
    past: str

    def form(self, plural: bool, past: bool) -> str:
        return self.past if past else (self.base if plural else self.s3)


def _nouns(kind: str, words: str) -> list[Noun]:
    return [Noun(*pair.split("/"), kind) for pair in words.split()]


def _verbs(words: str) -> list[Verb]:
    return [Verb(*triple.split("/")) for triple in words.split()]


PEOPLE = (_nouns("m", "boy/boys man/men king/kings brother/brothers father/fathers prince/princes uncle/uncles")
          + _nouns("f", "girl/girls woman/women queen/queens sister/sisters mother/mothers princess/princesses "
                        "aunt/aunts")
          + _nouns("p", "teacher/teachers child/children doctor/doctors farmer/farmers baby/babies friend/friends"))
ANIMALS = _nouns("a", "dog/dogs cat/cats bird/birds horse/horses mouse/mice fox/foxes rabbit/rabbits frog/frogs "
                      "duck/ducks bear/bears wolf/wolves")
THINGS = _nouns("t", "ball/balls box/boxes book/books key/keys tree/trees house/houses table/tables apple/apples "
                     "cake/cakes car/cars boat/boats hat/hats cup/cups flower/flowers stone/stones")
ANIMATE = PEOPLE + ANIMALS
GENDERED = [n for n in PEOPLE if n.kind in "mf"]
NAMES = {"m": "Ben Tom Sam Leo Max Jack Noah".split(), "f": "Anna Mia Lily Emma Rose Lucy Zoe".split()}

INTRANSITIVE = _verbs("sleeps/sleep/slept runs/run/ran sings/sing/sang laughs/laugh/laughed jumps/jump/jumped "
                      "waits/wait/waited smiles/smile/smiled swims/swim/swam dances/dance/danced cries/cry/cried "
                      "plays/play/played walks/walk/walked hides/hide/hid sits/sit/sat")
TRANSITIVE = _verbs("sees/see/saw likes/like/liked finds/find/found wants/want/wanted holds/hold/held "
                    "watches/watch/watched carries/carry/carried takes/take/took loves/love/loved "
                    "follows/follow/followed")
ANIMATE_OBJECT = _verbs("helps/help/helped chases/chase/chased hugs/hug/hugged calls/call/called "
                        "visits/visit/visited")
REFLEXIVE = _verbs("sees/see/saw likes/like/liked helps/help/helped watches/watch/watched hurts/hurt/hurt "
                   "washes/wash/washed loves/love/loved")
BE = Verb("is", "are", "was")
HAVE = Verb("has", "have", "had")

ADJ_ANIMATE = "happy sad tired hungry brave sleepy kind little old young".split()
ADJ_THING = "red blue green shiny heavy soft round big small old new".split()
PREPS = "near behind beside under with".split()
ADVERBS = {False: ["quietly", "slowly", "quickly", "every day", "at night", "today", "again"],
           True: ["quietly", "slowly", "quickly", "yesterday", "at night", "again", "last week"]}
SUBJECT = {"m": "he", "f": "she", "a": "it", "pl": "they"}
OBJECT = {"m": "him", "f": "her", "a": "it", "t": "it", "pl": "them"}
POSSESSIVE = {"m": "his", "f": "her", "a": "its", "pl": "their"}
REFLEXIVE_PRONOUN = {"m": "himself", "f": "herself", "a": "itself", "pl": "themselves"}


def be_form(plural: bool, past: bool) -> str:
    return ("were" if plural else "was") if past else ("are" if plural else "is")


class Grammar:
    """Sentence builders; each returns a list of words and draws only from `self.rng`."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def coin(self, p: float = 0.5) -> bool:
        return self.rng.random() < p

    def determiner(self, noun_word: str, plural: bool, demonstrative: bool = False) -> str:
        if demonstrative:
            return self.rng.choice(["these", "those"] if plural else ["this", "that"])
        options = ["the", "the", "some", "many", "two", "three", "my"] if plural else ["the", "the", "a", "my"]
        det = self.rng.choice(options)
        if det == "a" and noun_word[0] in "aeiou":
            det = "an"
        return det

    def np(self, noun: Noun, plural: bool, *, demonstrative: bool = False) -> list[str]:
        """A noun phrase: determiner, optional adjective, noun."""
        words = []
        if self.coin(0.3):
            words.append(self.rng.choice(ADJ_ANIMATE if noun.animate else ADJ_THING))
        words.append(noun.form(plural))
        return [self.determiner(words[0], plural, demonstrative)] + words

    def pp(self, plural: bool | None = None) -> list[str]:
        """A prepositional phrase whose noun is the attractor of long-distance agreement."""
        plural = self.coin() if plural is None else plural
        return [self.rng.choice(PREPS)] + self.np(self.rng.choice(ANIMATE + THINGS), plural)

    def predicate(self, plural: bool, past: bool) -> list[str]:
        """A verb phrase agreeing with an animate subject of number `plural`."""
        r = self.rng.random()
        if r < 0.15:
            return [be_form(plural, past), self.rng.choice(ADJ_ANIMATE)]
        if r < 0.3:
            return [HAVE.form(plural, past)] + self.np(self.rng.choice(THINGS + ANIMALS), self.coin())
        if r < 0.65:
            words = [self.rng.choice(INTRANSITIVE).form(plural, past)]
        else:
            obj = self.rng.choice(ANIMATE + THINGS)
            words = [self.rng.choice(TRANSITIVE).form(plural, past)] + self.np(obj, self.coin())
        if self.coin(0.25):
            words += self.rng.choice(ADVERBS[past]).split()
        return words

    def relative_clause(self, head_plural: bool, past: bool) -> list[str]:
        """`that` + clause; an object relative puts a second (attractor) subject between head and verb."""
        if self.coin():
            inner_plural = self.coin()
            verb = self.rng.choice(TRANSITIVE + ANIMATE_OBJECT).form(inner_plural, past)
            return ["that"] + self.np(self.rng.choice(ANIMATE), inner_plural) + [verb]
        verb = self.rng.choice(TRANSITIVE).form(head_plural, past)
        return ["that", verb] + self.np(self.rng.choice(ANIMATE + THINGS), self.coin())

    def reflexive_clause(self, noun: Noun, plural: bool, past: bool, attractor: bool) -> list[str]:
        kind = "pl" if plural else noun.kind
        words = self.np(noun, plural) + (self.pp() if attractor else [])
        return words + [self.rng.choice(REFLEXIVE).form(plural, past), REFLEXIVE_PRONOUN[kind]]

    def sentence(self, past: bool) -> list[str]:
        """One free-standing declarative sentence or yes/no question."""
        r = self.rng.random()
        plural = self.coin()
        if r < 0.3:
            return self.np(self.rng.choice(ANIMATE), plural) + self.predicate(plural, past)
        if r < 0.45:
            return self.np(self.rng.choice(ANIMATE), plural) + self.pp() + self.predicate(plural, past)
        if r < 0.6:
            noun = self.rng.choice(ANIMATE)
            return self.np(noun, plural) + self.relative_clause(plural, past) + self.predicate(plural, past)
        if r < 0.7:
            noun = self.rng.choice([n for n in ANIMATE if plural or n.kind != "p"])
            return self.reflexive_clause(noun, plural, past, attractor=self.coin())
        if r < 0.85:
            thing = self.np(self.rng.choice(THINGS), plural) + (self.pp() if self.coin() else [])
            return thing + [be_form(plural, past), self.rng.choice(ADJ_THING)]
        aux = ("did" if past else ("do" if plural else "does"))
        return [aux] + self.np(self.rng.choice(ANIMATE), plural) + [self.rng.choice(INTRANSITIVE).base, "?"]

    def story(self) -> list[list[str]]:
        """A protagonist, a possession, and sentences that refer back to both with pronouns."""
        past = self.coin(0.3)
        plural = self.coin(0.3)
        if plural or self.coin(0.4):
            hero = self.rng.choice(ANIMATE if plural else GENDERED + ANIMALS)
            hero_words, kind = self.np(hero, plural), ("pl" if plural else hero.kind)
        else:
            kind = self.rng.choice("mf")
            hero_words = [self.rng.choice(NAMES[kind])]
        thing_plural = self.coin(0.4)
        thing = self.np(self.rng.choice(THINGS + ANIMALS), thing_plural)
        out = [hero_words + [HAVE.form(plural, past)] + thing]
        for _ in range(self.rng.randint(2, 7)):
            out.append(self.story_sentence(kind, plural, thing_plural, past))
        return out

    def story_sentence(self, kind: str, plural: bool, thing_plural: bool, past: bool) -> list[str]:
        r = self.rng.random()
        subject = SUBJECT[kind]
        if r < 0.35:
            return [subject] + self.predicate(plural, past)
        if r < 0.55:
            verb = self.rng.choice(TRANSITIVE).form(plural, past)
            return [subject, verb, OBJECT["pl" if thing_plural else "t"]] + (["again"] if self.coin(0.2) else [])
        if r < 0.67:
            return [subject, self.rng.choice(REFLEXIVE).form(plural, past), REFLEXIVE_PRONOUN[kind]]
        if r < 0.8:
            owner = POSSESSIVE[kind]
            return [owner, self.rng.choice(ANIMALS + PEOPLE).form(False), self.rng.choice(ANIMATE_OBJECT).form(
                False, past), OBJECT[kind]]
        return self.sentence(past)


def render(words: list[str]) -> str:
    """Capitalised sentence with final punctuation (`?` kept as its own token until here)."""
    end = "?" if words[-1] == "?" else "."
    words = words[:-1] if end == "?" else words
    text = " ".join(words)
    return text[0].upper() + text[1:] + end


def generate_corpus(num_bytes: int, seed: int = 0) -> str:
    """Stories separated by blank lines (one document each), about `num_bytes` UTF-8 bytes."""
    grammar = Grammar(random.Random(seed))
    stories, size = [], 0
    while size < num_bytes:
        story = " ".join(render(s) for s in grammar.story())
        stories.append(story)
        size += len(story) + 2
    return "\n\n".join(stories) + "\n"


def corpus_path(megabytes: float = 2.0, seed: int = 0, cache_dir: str | os.PathLike | None = None) -> Path:
    """The builtin corpus as a text file in the cache, generated on first use (about 1 s per MB)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / "builtin" / f"grammar-v{CORPUS_VERSION}-seed{seed}-{megabytes:g}MB.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(generate_corpus(int(megabytes * 2**20), seed), encoding="utf-8")
        os.replace(tmp, path)  # concurrent ranks may both generate; the content is identical
    return path


def default_cache_dir() -> Path:
    return Path(os.environ.get("MOEP_CACHE_DIR") or Path.home() / ".cache" / "moep_ds")


# ---- minimal pairs: each builder returns (good words, bad words) -------------------------------------


def _determiner_noun(g: Grammar) -> tuple[list[str], list[str]]:
    plural, obj = g.coin(), g.rng.choice(ANIMALS + THINGS)
    subject = [g.rng.choice(NAMES[g.rng.choice("mf")])]
    verb = g.rng.choice(TRANSITIVE).s3
    det = g.determiner(obj.sg, plural, demonstrative=True)
    return subject + [verb, det, obj.form(plural)], subject + [verb, det, obj.form(not plural)]


def _subject_verb(g: Grammar) -> tuple[list[str], list[str]]:
    plural, verb = g.coin(), g.rng.choice(INTRANSITIVE)
    subject = g.np(g.rng.choice(ANIMATE), plural)
    return subject + [verb.form(plural, False)], subject + [verb.form(not plural, False)]


def _across_pp(g: Grammar) -> tuple[list[str], list[str]]:
    plural = g.coin()
    subject = g.np(g.rng.choice(THINGS), plural) + g.pp(plural=not plural)
    adj = g.rng.choice(ADJ_THING)
    return subject + [be_form(plural, False), adj], subject + [be_form(not plural, False), adj]


def _across_relative_clause(g: Grammar) -> tuple[list[str], list[str]]:
    plural, verb = g.coin(), g.rng.choice(INTRANSITIVE)
    inner = g.rng.choice(TRANSITIVE + ANIMATE_OBJECT).form(not plural, False)
    subject = g.np(g.rng.choice(ANIMATE), plural) + ["that"] + g.np(g.rng.choice(ANIMATE), not plural) + [inner]
    return subject + [verb.form(plural, False)], subject + [verb.form(not plural, False)]


def _anaphor_number(g: Grammar) -> tuple[list[str], list[str]]:
    plural, noun = g.coin(), g.rng.choice(GENDERED + ANIMALS)
    good = g.reflexive_clause(noun, plural, past=False, attractor=False)
    wrong = noun.kind if plural else "pl"
    return good, good[:-1] + [REFLEXIVE_PRONOUN[wrong]]


def _anaphor_gender(g: Grammar) -> tuple[list[str], list[str]]:
    noun = g.rng.choice(GENDERED)
    good = g.reflexive_clause(noun, False, past=False, attractor=False)
    return good, good[:-1] + [REFLEXIVE_PRONOUN["f" if noun.kind == "m" else "m"]]


def _question_aux(g: Grammar) -> tuple[list[str], list[str]]:
    plural = g.coin()
    rest = g.np(g.rng.choice(ANIMATE), plural) + [g.rng.choice(INTRANSITIVE).base, "?"]
    good, bad = ("do", "does") if plural else ("does", "do")
    return [good] + rest, [bad] + rest


PHENOMENA = {
    "determiner_noun_agreement": _determiner_noun,
    "subject_verb_agreement": _subject_verb,
    "agreement_across_prepositional_phrase": _across_pp,
    "agreement_across_relative_clause": _across_relative_clause,
    "anaphor_number_agreement": _anaphor_number,
    "anaphor_gender_agreement": _anaphor_gender,
    "question_auxiliary_agreement": _question_aux,
}


def minimal_pairs(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` pairs {"sentence_good", "sentence_bad", "phenomenon"}, phenomena in turn (BLiMP field names)."""
    grammar = Grammar(random.Random(seed))
    names = list(PHENOMENA)
    pairs = []
    for i in range(n):
        name = names[i % len(names)]
        good, bad = PHENOMENA[name](grammar)
        pairs.append({"sentence_good": render(good), "sentence_bad": render(bad), "phenomenon": name})
    return pairs


def pairs_per_phenomenon(num_pairs: int, seed: int = 0) -> dict[str, list[dict[str, str]]]:
    """`num_pairs` distinct pairs {"sentence_good", "sentence_bad", "phenomenon"} of each phenomenon.

    Each phenomenon draws from its own generator (seeded with "<seed>:<phenomenon>"), so adding a phenomenon
    or asking for more pairs leaves the pairs of the others unchanged (a larger request extends a smaller one).
    """
    out = {}
    for name, build in PHENOMENA.items():
        grammar = Grammar(random.Random(f"{seed}:{name}"))
        pairs: dict[str, dict[str, str]] = {}
        for _ in range(100 * num_pairs):  # the grammar has thousands of sentences per phenomenon
            if len(pairs) == num_pairs:
                break
            good, bad = build(grammar)
            pairs.setdefault(render(good), {"sentence_good": render(good), "sentence_bad": render(bad),
                                            "phenomenon": name})
        if len(pairs) < num_pairs:
            raise ValueError(f"the grammar has fewer than {num_pairs} distinct {name} pairs ({len(pairs)})")
        out[name] = list(pairs.values())
    return out
