// Validates rendered Kubernetes manifests offline, strictly:
//   - against the Kubernetes OpenAPI schemas as kubernetes-models compiles
//     them (required fields, types, enums, formats);
//   - rejecting any field the API does not define, found by walking each
//     object along the official client's (@kubernetes/client-node) type
//     maps, since those schemas allow unknown fields.
//
//   node validate.mjs FILE.yaml     exit 0: all valid; 1: each problem printed
import fs from 'node:fs';
import { createRequire } from 'node:module';

import * as k8s from '@kubernetes/client-node';
import yaml from 'js-yaml';

const require = createRequire(import.meta.url);

// "apps/v1" + "Deployment" -> the client's class name, "V1Deployment".
function className(apiVersion, kind) {
  const version = apiVersion.split('/').pop();
  return version[0].toUpperCase() + version.slice(1) + kind;
}

// kubernetes-models' class for the object (null: none).
function model(apiVersion, kind) {
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  try {
    const mod = require(`kubernetes-models/${group ? group + '/' : ''}${version}/${kind}`);
    return mod[kind];
  } catch {
    return null;
  }
}

const PRIMITIVES = {
  string: (v) => typeof v === 'string',
  number: (v) => typeof v === 'number',
  boolean: (v) => typeof v === 'boolean',
  Date: (v) => typeof v === 'string' || v instanceof Date,
  IntOrString: (v) => typeof v === 'string' || typeof v === 'number',
  any: () => true,
  object: () => true,
};

// Walks `value` as client type `type`, pushing "path: problem" to `errors`.
function walk(value, type, path, errors) {
  if (value === null || value === undefined) return;
  type = type.trim();
  let m;
  if ((m = /^Array<(.+)>$/.exec(type))) {
    if (!Array.isArray(value)) return errors.push(`${path}: expected a list`);
    value.forEach((v, i) => walk(v, m[1], `${path}[${i}]`, errors));
    return;
  }
  if ((m = /^\{ \[key: string\]: (.+); \}$/.exec(type))) {
    if (typeof value !== 'object' || Array.isArray(value)) return errors.push(`${path}: expected a map`);
    for (const [k, v] of Object.entries(value)) walk(v, m[1], `${path}.${k}`, errors);
    return;
  }
  if (type in PRIMITIVES) {
    if (!PRIMITIVES[type](value)) errors.push(`${path}: expected ${type}, got ${JSON.stringify(value)}`);
    return;
  }
  const cls = k8s[type];
  if (!cls || typeof cls.getAttributeTypeMap !== 'function') {
    // An enum or alias type the client spells as a string union.
    if (typeof value === 'object') errors.push(`${path}: expected a scalar of type ${type}`);
    return;
  }
  if (typeof value !== 'object' || Array.isArray(value)) return errors.push(`${path}: expected an object (${type})`);
  const attrs = new Map(cls.getAttributeTypeMap().map((a) => [a.baseName, a.type]));
  for (const [k, v] of Object.entries(value)) {
    if (!attrs.has(k)) {
      errors.push(`${path}.${k}: unknown field (not in ${type})`);
      continue;
    }
    walk(v, attrs.get(k), `${path}.${k}`, errors);
  }
}

const docs = yaml.loadAll(fs.readFileSync(process.argv[2], 'utf8')).filter(Boolean);
let problems = 0;
for (const doc of docs) {
  const name = `${doc.kind}/${doc.metadata?.name}`;
  const errors = [];
  const cls = className(doc.apiVersion ?? '', doc.kind ?? '');
  if (!k8s[cls]) {
    errors.push(`no Kubernetes type ${doc.apiVersion} ${doc.kind}`);
  } else {
    walk(doc, cls, '', errors);
  }
  const M = model(doc.apiVersion ?? '', doc.kind ?? '');
  if (M) {
    try {
      // kustomize wraps a Secret's base64 over lines; the API server's
      // decoder skips newlines, the schema's "byte" format does not.
      const checked = structuredClone(doc);
      if (doc.kind === 'Secret' && doc.data) {
        for (const k of Object.keys(checked.data)) checked.data[k] = String(checked.data[k]).replace(/\s+/g, '');
      }
      new M(checked).validate();
    } catch (e) {
      errors.push(`schema: ${e.message}`);
    }
  } else {
    errors.push(`no schema for ${doc.apiVersion} ${doc.kind}`);
  }
  for (const e of errors) console.log(`INVALID ${name}: ${e}`);
  problems += errors.length;
}
console.log(`${docs.length} objects, ${problems} problems`);
process.exit(problems === 0 ? 0 : 1);
