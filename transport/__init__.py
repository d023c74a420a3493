"""prefixstore.transport: how bytes move between a client and a store, and between nodes (the frame
transport over HTTP/1.1, direct socket sends, a streamed request body, the lazy nixl agent).

The part above protocol/ (DESIGN §2 as docs/design.md extends it): it imports protocol only, and
no HTTP library; store/ and client/ both use it. Import its modules by name
(``prefixstore.transport.frames``); the package itself exports nothing.
"""
