// Parse an AsyncAPI document with the official parser (@asyncapi/parser) and print every diagnostic;
// exit 1 on any of severity error or warning. tests/test_asyncapi_parser.py runs it on docs/asyncapi.yaml.
//
// The document's payloads are JSON Schema 2020-12 (`schemaFormat: application/schema+json;version=2020-12`),
// a format the parser has no schema parser for (it ships AsyncAPI's own, a draft-07 superset, and hands any
// other format's schemas through unread). The one registered here compiles each payload with ajv in
// 2020-12 mode, strictly, so that a payload that is not valid 2020-12 fails the parse like any other error
// (AsyncAPI 3 documents' custom formats are checked in `parse`: the parser calls `validate` only for 2.x).
import { createRequire } from 'node:module';
import { Parser, fromFile, DiagnosticSeverity } from '@asyncapi/parser';
import Ajv2020 from 'ajv/dist/2020.js';
import addFormats from 'ajv-formats';

export const JSON_SCHEMA_2020_12 = [
  'application/schema+json;version=2020-12',
  'application/schema+yaml;version=2020-12',
];

/** The reasons `schema` is not a valid JSON Schema 2020-12 (none: it is). */
function invalid(schema) {
  const ajv = new Ajv2020({ strict: true, allErrors: true });
  addFormats(ajv);
  try {
    ajv.compile(schema);
    return [];
  } catch (e) {
    return [e.message];
  }
}

let compiled = 0;

export const jsonSchema202012 = {
  getMimeTypes: () => JSON_SCHEMA_2020_12,
  validate: (input) =>
    invalid(input.data).map((why) => ({ message: `not a valid JSON Schema 2020-12: ${why}`, path: input.path })),
  parse(input) {
    const why = invalid(input.data);
    if (why.length) throw new Error(`${input.path.join('/')}: not a valid JSON Schema 2020-12: ${why.join('; ')}`);
    compiled += 1;
    return input.data;
  },
};

const file = process.argv[2];
if (!file) {
  console.error('usage: node check.mjs ASYNCAPI_FILE');
  process.exit(2);
}
const parser = new Parser({ schemaParsers: [jsonSchema202012] });
const { document, diagnostics } = await fromFile(parser, file).parse();
const names = { [DiagnosticSeverity.Error]: 'error', [DiagnosticSeverity.Warning]: 'warning',
  [DiagnosticSeverity.Information]: 'info', [DiagnosticSeverity.Hint]: 'hint' };
const count = { error: 0, warning: 0, info: 0, hint: 0 };
for (const d of diagnostics) {
  const severity = names[d.severity];
  count[severity] += 1;
  console.log(`${severity} ${d.code} at ${d.path.join('/') || '/'}: ${d.message}`);
}
const { version } = createRequire(import.meta.url)('@asyncapi/parser/package.json');
console.log(`@asyncapi/parser ${version}: ${count.error} errors, ${count.warning} warnings, ` +
  `${count.info} infos, ${count.hint} hints; ${compiled} payloads compiled as JSON Schema 2020-12` +
  `${document ? '' : ' (no document)'}`);
process.exit(count.error || count.warning || !document ? 1 : 0);
