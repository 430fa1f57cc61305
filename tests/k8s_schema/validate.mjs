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

// Custom resources the projects ship, with no schema in the core models:
// their documented structure, checked as strictly (unknown fields refused).
function checkPrometheusRule(doc, errors) {
  const only = (obj, path, allowed) => {
    if (typeof obj !== 'object' || obj === null || Array.isArray(obj)) return errors.push(`${path}: expected an object`);
    for (const k of Object.keys(obj)) if (!allowed.includes(k)) errors.push(`${path}.${k}: unknown field`);
  };
  only(doc, '', ['apiVersion', 'kind', 'metadata', 'spec']);
  walk(doc.metadata, 'V1ObjectMeta', '.metadata', errors);
  only(doc.spec, '.spec', ['groups']);
  (doc.spec?.groups ?? []).forEach((g, i) => {
    const gp = `.spec.groups[${i}]`;
    only(g, gp, ['name', 'interval', 'rules', 'limit', 'partial_response_strategy']);
    if (typeof g.name !== 'string') errors.push(`${gp}.name: required string`);
    (g.rules ?? []).forEach((r, j) => {
      const rp = `${gp}.rules[${j}]`;
      only(r, rp, ['alert', 'record', 'expr', 'for', 'keep_firing_for', 'labels', 'annotations']);
      if ((typeof r.alert === 'string') === (typeof r.record === 'string')) errors.push(`${rp}: one of alert or record`);
      if (typeof r.expr !== 'string' || !r.expr.trim()) errors.push(`${rp}.expr: required string`);
      if (r.for !== undefined && !/^(\d+(ms|s|m|h|d|w|y))+$/.test(r.for)) errors.push(`${rp}.for: not a duration`);
      for (const m of ['labels', 'annotations']) {
        for (const [k, v] of Object.entries(r[m] ?? {})) if (typeof v !== 'string') errors.push(`${rp}.${m}.${k}: expected string`);
      }
    });
  });
}
const CUSTOM = { 'monitoring.coreos.com/v1 PrometheusRule': checkPrometheusRule };

const docs = yaml.loadAll(fs.readFileSync(process.argv[2], 'utf8')).filter(Boolean);
let problems = 0;
for (const doc of docs) {
  const name = `${doc.kind}/${doc.metadata?.name}`;
  const errors = [];
  const custom = CUSTOM[`${doc.apiVersion} ${doc.kind}`];
  if (custom) {
    custom(doc, errors);
    for (const e of errors) console.log(`INVALID ${name}: ${e}`);
    problems += errors.length;
    continue;
  }
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
