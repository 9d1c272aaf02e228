#!/usr/bin/env node
// Follow rackplane's events as a third party would, from Node: a durable pull consumer (nats.js) that
// checks every message against the published JSON Schemas (docs/schemas/, with ajv in 2020-12 strict
// mode), not against rackplane's code.
//
//     node consume.mjs [--context FILE] [--schemas DIR] [--count N]
//
// It needs only nats and ajv (with ajv-formats, for the schemas' `uuid` and `date-time`). It connects with
// the identity of a rackctl context file (`{"url", "nkey", "ca", "identity", "stream", "silo"}`) and reads
// its replies on that identity's private inbox `_INBOX_<identity>` (the broker lets no identity read
// another's). It binds the durable named after the identity on the context's stream (`EVENTS` when the
// context names none), filtered to `rp.evt.>` (or `rp.evt.<silo>.>` for a silo's subscriber), creating it
// on its first run from the newest event on: a restart resumes where the durable left off. Each valid
// event is printed (in the newest version of its schema that it has: an older copy of the same change is
// acknowledged unread), one line each, then acknowledged; one that fails its schema, or whose schema and
// version have no file here, is reported on stderr and terminated (kept by the broker, never redelivered).

import { readFileSync, readdirSync } from "node:fs";
import path from "node:path";
import process from "node:process";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

import Ajv2020 from "ajv/dist/2020.js";
import addFormats from "ajv-formats";
import { AckPolicy, DeliverPolicy, connect, nanos, nkeyAuthenticator } from "nats";

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, "..", "..");
const DEFAULT_STREAM = "EVENTS"; // a context of the release before subscribers' own streams names none
const SCHEMA_FILE = /^(?<name>.+)\.v(?<version>\d+)\.json$/;

/** Every `<schema>.v<version>.json` of the folder, compiled strictly (an unknown keyword, a loose type or
 * a bad format is an error at start, not a silent pass later), keyed by `<schema> v<version>`. */
function loadSchemas(folder) {
  const ajv = new Ajv2020({ strict: true, allErrors: false });
  addFormats(ajv);
  const validators = new Map();
  const newest = new Map();
  for (const file of readdirSync(folder).sort()) {
    const m = SCHEMA_FILE.exec(file);
    if (!m) continue;
    const { name } = m.groups;
    const version = Number(m.groups.version);
    const schema = JSON.parse(readFileSync(path.join(folder, file), "utf8"));
    try {
      validators.set(`${name} v${version}`, ajv.compile(schema));
    } catch (e) {
      throw new Error(`${file}: ${e.message}`);
    }
    newest.set(name, Math.max(newest.get(name) ?? 0, version));
  }
  return { validators, newest };
}

/** [the message, null] if it is valid against the schema of its own schema and version, else [null, why]. */
function check(schemas, data) {
  let message;
  try {
    message = JSON.parse(new TextDecoder().decode(data));
  } catch {
    message = undefined;
  }
  if (message === null || typeof message !== "object" || !("schema" in message) || !("version" in message)) {
    return [null, "not a JSON envelope with a schema and a version"];
  }
  const key = `${message.schema} v${message.version}`;
  const validate = schemas.validators.get(key);
  if (validate === undefined) {
    return [null, `no published schema ${key} here (a newer producer? update the schemas)`];
  }
  if (!validate(message)) {
    const [error] = validate.errors;
    return [null, `${key}: ${error.instancePath || "(the message)"}: ${error.message}`];
  }
  return [message, null];
}

/** Whether a newer version of this message's schema is published: while rackplane sends both versions of
 * a change (its deprecation window, docs/subjects.md "Versions"), a reader follows the newest it knows and
 * acknowledges the older copy unread. (It assumes every producer sends the newest version: see the README
 * on a rolling upgrade from the release before v2.) */
function superseded(schemas, message) {
  return (schemas.newest.get(message.schema) ?? 0) > message.version;
}

/** JSON as Python's `json.dumps(value, sort_keys=True)` writes it, so both examples print the same line. */
function pyJson(value) {
  if (Array.isArray(value)) return `[${value.map(pyJson).join(", ")}]`;
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value).sort();
    return `{${keys.map((k) => `${pyJson(k)}: ${pyJson(value[k])}`).join(", ")}}`;
  }
  const text = JSON.stringify(value);
  return text.replace(/[\u0080-\uffff]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

function summary(subject, message) {
  const data = message.data;
  let what;
  if (data.instance !== null && typeof data.instance === "object") {
    const v = data.instance;
    what = `${v.silo}/${v.project}/${v.name} ${v.state} (generation ${v.generation})`;
  } else {
    what = pyJson(data);
  }
  return `${message.time}  ${subject}  ${what}`;
}

function options() {
  const home = process.env.RACKPLANE_HOME || path.join(REPO, ".rackplane");
  const { values } = parseArgs({
    options: {
      context: { type: "string", default: path.join(home, "contexts", "events-reader.json") },
      schemas: { type: "string", default: path.join(REPO, "docs", "schemas") },
      count: { type: "string" },
      help: { type: "boolean", short: "h" },
    },
  });
  if (values.help) {
    console.log("usage: node consume.mjs [--context FILE] [--schemas DIR] [--count N]");
    process.exit(0);
  }
  const count = values.count === undefined ? Infinity : Number(values.count);
  if (!(Number.isInteger(count) && count > 0) && count !== Infinity) {
    throw new Error(`--count: not a positive number: ${values.count}`);
  }
  return { ...values, count };
}

async function main() {
  const opts = options();
  const context = JSON.parse(readFileSync(opts.context, "utf8"));
  const schemas = loadSchemas(opts.schemas);
  const identity = context.identity;
  const stream = context.stream || DEFAULT_STREAM;
  const filter = context.silo ? `rp.evt.${context.silo}.>` : "rp.evt.>";
  const durable = identity;

  const seed = context.nkey ? new TextEncoder().encode(readFileSync(context.nkey, "utf8").trim()) : null;
  const nc = await connect({
    servers: context.url,
    name: "events-consumer-node-example",
    inboxPrefix: `_INBOX_${identity}`, // the only inbox the broker lets this identity read
    maxReconnectAttempts: -1,
    ...(seed ? { authenticator: nkeyAuthenticator(seed) } : {}),
    ...(context.ca ? { tls: { caFile: context.ca } } : {}),
  });
  (async () => {
    for await (const s of nc.status()) {
      if (s.type === "error" || s.type === "disconnect") console.error(`nats: ${s.type}: ${s.data}`);
    }
  })();

  // No `$JS.API.INFO` check: a subscriber may use its own stream's consumers and nothing more.
  const jsm = await nc.jetstreamManager({ checkAPI: false });
  try {
    await jsm.consumers.info(stream, durable);
  } catch (e) {
    if (e?.api_error?.err_code !== 10014) throw e; // anything but "consumer not found"
    // A name and one filter: nats.js puts the filter in the create subject, which the broker checks.
    await jsm.consumers.add(stream, {
      durable_name: durable,
      filter_subject: filter,
      ack_policy: AckPolicy.Explicit,
      deliver_policy: DeliverPolicy.New, // when first created; afterwards it resumes where it was
      ack_wait: nanos(30_000),
    });
  }
  const consumer = await nc.jetstream().consumers.get(stream, durable);
  const messages = await consumer.consume({ max_messages: 16 });
  for (const signal of ["SIGINT", "SIGTERM"]) process.once(signal, () => messages.stop());
  console.error(`following ${filter} on ${stream} as ${identity} (durable ${durable})`);

  let seen = 0;
  try {
    for await (const msg of messages) {
      const [message, why] = check(schemas, msg.data);
      if (message === null) {
        console.error(`refused ${msg.subject}: ${why}`);
        msg.term();
        continue;
      }
      if (superseded(schemas, message)) {
        await msg.ackAck();
        continue;
      }
      console.log(summary(msg.subject, message));
      await msg.ackAck();
      if (++seen >= opts.count) break;
    }
  } finally {
    messages.stop();
    await nc.drain();
  }
}

main().catch((e) => {
  console.error(`error: ${e.message}`);
  process.exit(1);
});
