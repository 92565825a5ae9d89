"""The HTTP front door of ``specd-scheduler``: an ASGI app (Starlette) served by uvicorn.

``app`` routes and answers, ``door`` holds the admission counts and reads a request's events,
``models`` types the request bodies, ``errors`` shapes the error answers, ``server`` runs uvicorn on its own thread with header and body timeouts.
"""
