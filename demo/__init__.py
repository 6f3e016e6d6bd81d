"""The bundled demo: a dataset of conversations, images and video clips with bad rows among them
(``data``, ``clips``), and tiny offline model folders, made on the spot for ``make demo`` and the
tests."""
