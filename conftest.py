# Keeps the outputs of nbval's notebook runs for the book (see book/nbcapture.py).
pytest_plugins = ["book.nbcapture"]
