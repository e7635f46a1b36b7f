"""LogiQA prompt, as lm-eval's tasks/logiqa/utils_logiqa.py."""


def logiqa_doc_to_text(doc: dict) -> str:
    """Passage, question, lettered choices, then 'Answer:'."""
    prompt = "Passage: " + doc["context"] + "\n"
    prompt += "Question: " + doc["question"] + "\nChoices:\n"
    for letter, option in zip("ABCD", doc["options"]):
        prompt += f"{letter}. {option}\n"
    return prompt + "Answer:"


def logiqa_doc_to_target(doc: dict) -> int:
    return "abcd".index(doc["label"].strip())
