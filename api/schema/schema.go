// Package schema checks the YAML documents tokenbroker reads (the policy,
// the agent config, serve's config file) the way their loaders decode
// them, but reports every problem at once with its field path: unknown
// fields with a did-you-mean, values of the wrong type, and a loader's own
// field problems. "tokenbroker config validate" is built on it; the owners
// of each document (broker, agent, cmd) say which Go type and which loader.
package schema

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// LoaderProblems turns a loader's error into problems: its field problems
// if it has them, else the error itself.
func LoaderProblems(err error) []apiv1.FieldError {
	if err == nil {
		return nil
	}
	if ve := (*apiv1.ValidationError)(nil); errors.As(err, &ve) {
		return ve.Problems
	}
	return []apiv1.FieldError{{Detail: err.Error()}}
}

// NotAFileKey reports flags that a config file cannot set.
func NotAFileKey(name string) bool { return name == "help" || name == "config" }

// UnknownKey is the detail of a key nothing reads.
const UnknownKey = "unknown key"

// FlagFileProblems checks the settings of a config file whose keys are the
// flag names of fs: every key must be a flag and every value must parse as
// the flag's type (a duration as "30s", a number as a number). It returns
// the problems and the settings without the keys that have one.
func FlagFileProblems(fs *pflag.FlagSet, settings map[string]any) ([]apiv1.FieldError, map[string]any) {
	var probs []apiv1.FieldError
	var names []string
	fs.VisitAll(func(f *pflag.Flag) {
		if !NotAFileKey(f.Name) {
			names = append(names, f.Name)
		}
	})
	clean := map[string]any{}
	for _, k := range sortedKeys(settings) {
		f := fs.Lookup(k)
		if f == nil || NotAFileKey(k) {
			probs = append(probs, apiv1.FieldError{Field: k, Detail: UnknownKey + DidYouMean(k, names)})
			continue
		}
		if msg := flagValueProblem(f.Value.Type(), settings[k]); msg != "" {
			probs = append(probs, apiv1.FieldError{Field: k, Detail: msg})
			continue
		}
		clean[k] = settings[k]
	}
	return probs, clean
}

// flagValueProblem says why v cannot be the value of a flag of pflag type
// typ, or "". viper would turn most such values into zero without a word.
func flagValueProblem(typ string, v any) string {
	if v == nil {
		return ""
	}
	s, isString := v.(string)
	scalar := isString || isNumber(v)
	if _, ok := v.(bool); ok {
		scalar = true
	}
	switch typ {
	case "string":
		if !scalar {
			return "must be a string, not " + describe(v)
		}
	case "bool":
		if _, ok := v.(bool); ok {
			return ""
		}
		if _, err := strconv.ParseBool(s); !isString || err != nil {
			return "must be true or false, not " + describe(v)
		}
	case "int", "int8", "int16", "int32", "int64", "uint", "uint8", "uint16", "uint32", "uint64":
		if isString {
			if _, err := strconv.ParseInt(s, 10, 64); err == nil {
				return ""
			}
			return "must be a whole number, not " + describe(v)
		}
		if f, ok := toFloat(v); !ok || f != float64(int64(f)) {
			return "must be a whole number, not " + describe(v)
		}
	case "float32", "float64":
		if isString {
			if _, err := strconv.ParseFloat(s, 64); err == nil {
				return ""
			}
		}
		if !isNumber(v) {
			return "must be a number, not " + describe(v)
		}
	case "duration":
		if !isString {
			return `must be a duration such as "30s" (a string with a unit), not ` + describe(v)
		}
		if _, err := time.ParseDuration(s); err != nil {
			return `must be a duration such as "30s": ` + err.Error()
		}
	case "stringSlice", "stringArray":
		if isString {
			return ""
		}
		list, ok := v.([]any)
		if !ok {
			return "must be a list of strings, not " + describe(v)
		}
		for _, e := range list {
			if flagValueProblem("string", e) != "" {
				return "must be a list of strings, not a list with " + describe(e)
			}
		}
	}
	return ""
}

func isNumber(v any) bool {
	_, ok := toFloat(v)
	return ok
}

func toFloat(v any) (float64, bool) {
	switch n := v.(type) {
	case int:
		return float64(n), true
	case int8:
		return float64(n), true
	case int16:
		return float64(n), true
	case int32:
		return float64(n), true
	case int64:
		return float64(n), true
	case uint:
		return float64(n), true
	case uint8:
		return float64(n), true
	case uint16:
		return float64(n), true
	case uint32:
		return float64(n), true
	case uint64:
		return float64(n), true
	case float32:
		return float64(n), true
	case float64:
		return n, true
	}
	return 0, false
}

// describe names the YAML type of v for messages.
func describe(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case string:
		return fmt.Sprintf("the string %q", x)
	case bool:
		return fmt.Sprintf("the boolean %t", x)
	case []any:
		return "a list"
	case map[string]any:
		return "a map"
	}
	if isNumber(v) {
		return fmt.Sprintf("the number %v", v)
	}
	return fmt.Sprintf("%T", v)
}

// Checker compares a decoded YAML document with the Go type its
// loader decodes it into (with encoding/json, so json tags name the fields
// and matching is case-insensitive as there), and records every unknown
// field and every value of the wrong type, where the loader stops at the
// first.
type Checker struct {
	Problems []apiv1.FieldError
	// typed are the paths of values of the wrong type: the loader's
	// checks of them ("is required") would only repeat the problem.
	typed []string
}

var jsonUnmarshalerType = reflect.TypeFor[json.Unmarshaler]()

// Check returns v without what does not fit t: unknown keys are left out,
// values of the wrong type become null (list elements keep their index, so
// that the loader's paths stay right).
func (c *Checker) Check(path string, v any, t reflect.Type) any {
	if v == nil {
		return nil
	}
	bad := func(format string, args ...any) any {
		c.Problems = append(c.Problems, apiv1.FieldError{Field: path, Detail: fmt.Sprintf(format, args...)})
		c.typed = append(c.typed, path)
		return nil
	}
	if t.Kind() != reflect.Pointer && reflect.PointerTo(t).Implements(jsonUnmarshalerType) {
		raw, _ := json.Marshal(v)
		if err := json.Unmarshal(raw, reflect.New(t).Interface()); err != nil {
			return bad("%s", strings.TrimPrefix(err.Error(), "json: "))
		}
		return v
	}
	switch t.Kind() {
	case reflect.Pointer:
		return c.Check(path, v, t.Elem())
	case reflect.Struct:
		m, ok := v.(map[string]any)
		if !ok {
			return bad("must be a map of fields, not %s", describe(v))
		}
		fields := jsonFields(t)
		names := make([]string, len(fields))
		for i, f := range fields {
			names[i] = f.name
		}
		out := map[string]any{}
		for _, k := range sortedKeys(m) {
			f, ok := findField(fields, k)
			if !ok {
				c.Problems = append(c.Problems, apiv1.FieldError{Field: joinPath(path, k), Detail: "unknown field" + DidYouMean(k, names)})
				continue
			}
			if nv := c.Check(joinPath(path, f.name), m[k], f.typ); nv != nil {
				out[k] = nv
			}
		}
		return out
	case reflect.Map:
		m, ok := v.(map[string]any)
		if !ok {
			return bad("must be a map, not %s", describe(v))
		}
		out := map[string]any{}
		for _, k := range sortedKeys(m) {
			if nv := c.Check(mapPath(path, k), m[k], t.Elem()); nv != nil {
				out[k] = nv
			}
		}
		return out
	case reflect.Slice, reflect.Array:
		l, ok := v.([]any)
		if !ok {
			return bad("must be a list, not %s", describe(v))
		}
		out := make([]any, len(l))
		for i, e := range l {
			out[i] = c.Check(fmt.Sprintf("%s[%d]", path, i), e, t.Elem())
		}
		return out
	case reflect.String:
		if _, ok := v.(string); !ok {
			return bad("must be a string, not %s", describe(v))
		}
	case reflect.Bool:
		if _, ok := v.(bool); !ok {
			return bad("must be true or false, not %s", describe(v))
		}
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if f, ok := v.(float64); !ok || f != float64(int64(f)) {
			return bad("must be a whole number, not %s", describe(v))
		}
	case reflect.Float32, reflect.Float64:
		if _, ok := v.(float64); !ok {
			return bad("must be a number, not %s", describe(v))
		}
	}
	return v
}

// Without drops the loader's problems about values the shape check already
// found of the wrong type, and anything under them.
func (c *Checker) Without(probs []apiv1.FieldError) []apiv1.FieldError {
	var out []apiv1.FieldError
	for _, p := range probs {
		covered := false
		for _, t := range c.typed {
			if t == "" || p.Field == t || strings.HasPrefix(p.Field, t+".") || strings.HasPrefix(p.Field, t+"[") {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, p)
		}
	}
	return out
}

type jsonField struct {
	name string
	typ  reflect.Type
}

// jsonFields lists the fields encoding/json decodes into t, in order.
func jsonFields(t reflect.Type) []jsonField {
	var out []jsonField
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "-" {
			continue
		}
		if f.Anonymous && name == "" && f.Type.Kind() == reflect.Struct {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		if name == "" {
			name = f.Name
		}
		out = append(out, jsonField{name: name, typ: f.Type})
	}
	return out
}

func FieldNames(t reflect.Type) []string {
	var names []string
	for _, f := range jsonFields(t) {
		names = append(names, f.name)
	}
	return names
}

// findField finds the field of key as encoding/json does: the exact name,
// else one that differs only in case.
func findField(fields []jsonField, key string) (jsonField, bool) {
	for _, f := range fields {
		if f.name == key {
			return f, true
		}
	}
	for _, f := range fields {
		if strings.EqualFold(f.name, key) {
			return f, true
		}
	}
	return jsonField{}, false
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

var plainKey = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

// mapPath is the path of a map entry: labels.team, or
// labels["app.kubernetes.io/name"] for keys with dots or slashes.
func mapPath(path, key string) string {
	if plainKey.MatchString(key) {
		return joinPath(path, key)
	}
	return path + "[" + strconv.Quote(key) + "]"
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// DidYouMean suggests the known name closest to an unknown key, if one is
// close enough to be a typo.
func DidYouMean(key string, known []string) string {
	best, bestD := "", 3
	lk := strings.ToLower(key)
	for _, k := range known {
		if d := editDistance(lk, strings.ToLower(k)); d < bestD {
			best, bestD = k, d
		}
	}
	if best == "" && len(key) >= 3 {
		// A shortened name: opsAddr for opsAddress.
		for _, k := range known {
			if strings.HasPrefix(strings.ToLower(k), lk) {
				best = k
				break
			}
		}
	}
	if best == "" {
		return ""
	}
	return fmt.Sprintf(" (did you mean %q?)", best)
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

var indexInPath = regexp.MustCompile(`\[(\d+)\]`)

// Sort orders problems by field path, list indexes by number
// (peers[2] before peers[10]); problems of one field keep their order.
func Sort(probs []apiv1.FieldError) {
	key := func(p string) string {
		return indexInPath.ReplaceAllStringFunc(p, func(m string) string {
			n, _ := strconv.Atoi(m[1 : len(m)-1])
			return fmt.Sprintf("[%09d]", n)
		})
	}
	sort.SliceStable(probs, func(i, j int) bool { return key(probs[i].Field) < key(probs[j].Field) })
}

// Kind is one kind of document: its name, how to describe it when the
// kind cannot be told, the top-level keys that tell it apart, and its
// owner's check (problems make it invalid; notes are what could not be
// checked here).
type Kind struct {
	Name        string
	Description string
	Keys        []string
	Check       func(path string, doc any) (problems, notes []apiv1.FieldError)
}

// Result is what CheckDocument found in one document.
type Result struct {
	Kind string
	// Problems make the document invalid, sorted by field path.
	Problems []apiv1.FieldError
	// Notes are what could not be checked here.
	Notes []apiv1.FieldError
}

// CheckDocument checks the YAML document data, read from path, as the kind
// named (or, for "", the kind its keys say). The error is for a document
// whose kind cannot be told; everything wrong inside it is a problem.
func CheckDocument(path string, data []byte, kind string, kinds []Kind) (Result, error) {
	res := Result{Kind: kind}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		if res.Kind == "" {
			res.Kind = "YAML"
		}
		res.Problems = []apiv1.FieldError{{Detail: "not valid YAML: " + strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")}}
		return res, nil
	}
	var doc any
	if err := json.Unmarshal(js, &doc); err != nil {
		return Result{}, fmt.Errorf("%s: %w", path, err)
	}
	if res.Kind == "" {
		if res.Kind, err = detectKind(doc, kinds); err != nil {
			return Result{}, fmt.Errorf("%s: %w", path, err)
		}
	}
	for _, k := range kinds {
		if k.Name == res.Kind {
			res.Problems, res.Notes = k.Check(path, doc)
			Sort(res.Problems)
			return res, nil
		}
	}
	return Result{}, fmt.Errorf("unknown kind %q", res.Kind)
}

// detectKind tells the kind of a document by its top-level keys: the kind
// that knows the most of them, if only one does.
func detectKind(doc any, kinds []Kind) (string, error) {
	names, descriptions := make([]string, len(kinds)), make([]string, len(kinds))
	for i, k := range kinds {
		names[i], descriptions[i] = k.Name, k.Description
	}
	m, ok := doc.(map[string]any)
	if !ok || len(m) == 0 {
		return "", fmt.Errorf("not a YAML map of keys, so not a %s config", orList(names))
	}
	best, bestScore, tie := "", 0, false
	for _, kind := range kinds {
		score := 0
		for k := range m {
			for _, name := range kind.Keys {
				if strings.EqualFold(k, name) {
					score++
					break
				}
			}
		}
		switch {
		case score > bestScore:
			best, bestScore, tie = kind.Name, score, false
		case score == bestScore && score > 0:
			tie = true
		}
	}
	if bestScore == 0 || tie {
		return "", fmt.Errorf("cannot tell whether this is %s; give its kind (--kind)", orList(descriptions))
	}
	return best, nil
}

// orList joins "a", "b" and "c" as "a, b or c".
func orList(items []string) string {
	if len(items) < 2 {
		return strings.Join(items, "")
	}
	return strings.Join(items[:len(items)-1], ", ") + " or " + items[len(items)-1]
}
