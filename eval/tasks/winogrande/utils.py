"""WinoGrande prompt, as lm-eval's tasks/winogrande/preprocess_winogrande.py: partial scoring, where each choice
is the sentence up to the blank with one option filled in, and the target is the text after the blank."""


def doc_to_text(doc: dict) -> int:
    """The index of the correct choice (lm-eval's convention for a task whose choices are contexts)."""
    return {"1": 0, "2": 1}[str(doc["answer"])]


def doc_to_target(doc: dict) -> str:
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


def doc_to_choice(doc: dict) -> list[str]:
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]
