"""Constants shared by the data pipeline and the model (a module of its own so that neither imports the other)."""

IGNORE_INDEX = -100  # a target that is not trained on: a document's last token, MTP positions past a document end
