"""The site's gunicorn settings, read by ``gunicorn project.wsgi`` started here.

gunicorn answers some malformed requests itself, in HTML, before Django sees
them. Its limits are set so that no request the coordination API accepts meets
them: the longest lock key is 200 characters, and a request line of up to
8,190 bytes (gunicorn's largest bounded limit; its default is 4,094) still
reaches the API, which refuses a key that is too long with its JSON 400. Past
these limits gunicorn answers 414 (request line) or 431/400 (a header) in
HTML, and 400 for a request it cannot frame (``Content-Length: -1``); the
docs' security page lists them.
"""

limit_request_line = 8190
limit_request_field_size = 8190
limit_request_fields = 100
