"""The wire: the message envelope (frames), each message declared once (protocol), ZeroMQ sockets (transport), delta
weight pushes and their entry names, and SGLang's weight payload layout."""
