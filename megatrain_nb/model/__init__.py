"""The Hugging Face model as units the step can stream: where its pieces are (``hf.py``: embed, layers,
final norm, head, the prelude, weightless templates) and how a template runs on views of a flat buffer
(``binding.py``). Holds no weights and knows no devices, streams or optimizer; everything else imports it.
"""
