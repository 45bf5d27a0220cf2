"""Text: tokenizers, chat templates and the text of answers.

A chat prompt, in order: chat_messages.py makes the request's messages into what a template
reads -> chat_template.py renders the GGUF file's template in a sandbox (jinja_env.py;
template_caps.py probes what it can do) -> tokenizer.py splits out special tokens,
pre-tokenizes (pretokenize.py) and runs the vocabulary's model (bpe.py, spm.py, wordpiece.py;
chunks.py cuts a long text where no merge can join, and bounds its token count from its
bytes). Back out: decoder.py turns tokens into UTF-8 text as they come, stop.py holds back
what may become a stop string.
"""
