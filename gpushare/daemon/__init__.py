"""The daemon: composition root, run loop, socket server, registry and launcher."""
