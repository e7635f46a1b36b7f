"""SuperGLUE WSC prompt, as lm-eval's tasks/super_glue/wsc/preprocess_wsc.py."""
from lm_eval.utils import general_detokenize


def wsc_doc_to_text(doc: dict) -> str:
    """The passage with the pronoun marked *like this*, and a yes/no question about its referent."""
    # span indices count words, not characters
    pre = " ".join(doc["text"].split()[: doc["span2_index"]])
    post = doc["text"][len(pre) + len(doc["span2_text"]) + 1:]
    passage = general_detokenize(pre + " *{}*".format(doc["span2_text"]) + post)
    return (
        f"Passage: {passage}\n"
        f'Question: In the passage above, does the pronoun "*{doc["span2_text"]}*" refer to "*{doc["span1_text"]}*"?\n'
        "Answer:"
    )
