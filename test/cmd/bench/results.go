package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
)

// writeResultsKey sets key in the JSON object stored in file to v and
// leaves the object's other keys as they are, in their order: several
// measurements share bench/results.json, each owning its own keys, and a
// run of one must not drop the figures of another. A missing file is an
// empty object; a file that is not a JSON object is an error, not
// overwritten. The file is replaced by a rename, so a failed run leaves
// the old one.
func writeResultsKey(file, key string, v any) error {
	val, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return mergeResults(file, []field{{key, val}})
}

// writeResultsKeys is writeResultsKey for each key of v, a struct or map
// that encodes as a JSON object. A key v leaves out (omitempty) keeps the
// value a former run wrote.
func writeResultsKeys(file string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	fields, err := objectFields(b)
	if err != nil {
		return err
	}
	return mergeResults(file, fields)
}

// mergeResults sets the given keys in the JSON object in file, replacing
// each in place or adding it at the end.
func mergeResults(file string, set []field) error {
	old, err := os.ReadFile(file)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	fields, err := objectFields(old)
	if err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	for _, f := range set {
		i := slices.IndexFunc(fields, func(g field) bool { return g.key == f.key })
		if i < 0 {
			fields = append(fields, f)
		} else {
			fields[i].value = f.value
		}
	}
	// Indented as json.MarshalIndent(obj, "", "  ") indents, so that the
	// keys left alone show no change in a diff.
	var b bytes.Buffer
	b.WriteString("{")
	for i, f := range fields {
		if i > 0 {
			b.WriteString(",")
		}
		k, _ := json.Marshal(f.key)
		b.WriteString("\n  ")
		b.Write(k)
		b.WriteString(": ")
		if err := json.Indent(&b, f.value, "  ", "  "); err != nil {
			return fmt.Errorf("%s: key %s: %w", file, f.key, err)
		}
	}
	if len(fields) > 0 {
		b.WriteString("\n")
	}
	b.WriteString("}\n")
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(file), ".results-*.json")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after a successful rename there is nothing to remove
	if _, err := tmp.Write(b.Bytes()); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), file)
}

// field is one key of a JSON object and its value as written.
type field struct {
	key   string
	value json.RawMessage
}

// objectFields splits a JSON object into its keys and values, in order.
// Empty input is an empty object.
func objectFields(data []byte) ([]field, error) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, nil
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return nil, errors.New("not a JSON object")
	}
	var out []field
	for dec.More() {
		t, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key, _ := t.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, fmt.Errorf("key %s: %w", key, err)
		}
		out = append(out, field{key, raw})
	}
	if t, err := dec.Token(); err != nil || t != json.Delim('}') {
		return nil, errors.New("not a JSON object")
	}
	if _, err := dec.Token(); err == nil {
		return nil, errors.New("more than one JSON value")
	}
	return out, nil
}
