-- wrk script: POST one body file to the URL given on the command line.
--
--   wrk -t1 -c4 -d5s --latency -s bench/wrk/query.lua http://127.0.0.1:13333/query \
--       -- bench/wrk/q4k.body application/msgpack
--
-- Arguments after "--": the body file (required) and its Content-Type (default
-- application/msgpack). Bodies come from bench/make_query_body.py. There is no
-- response() hook on purpose (it would cost wrk time per request); wrk itself
-- reports "Non-2xx or 3xx responses" when an answer is not 200.

function init(args)
   local path = args[1]
   if path == nil then
      error("usage: wrk ... -s bench/wrk/query.lua <url> -- <body file> [content type]")
   end
   local f = assert(io.open(path, "rb"))
   wrk.body = f:read("*a")
   f:close()
   wrk.method = "POST"
   wrk.headers["Content-Type"] = args[2] or "application/msgpack"
end
