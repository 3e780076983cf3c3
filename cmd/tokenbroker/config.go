package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/agent"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
)

// The kinds of configuration file "config validate" knows.
const (
	kindAuto   = "auto"
	kindPolicy = "policy"
	kindAgent  = "agent"
	kindServe  = "serve"
)

var configKinds = []string{kindAuto, kindPolicy, kindAgent, kindServe}

// maxConfigFileBytes is the size limit of the policy and agent loaders.
const maxConfigFileBytes = 1 << 20

func newConfigCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Work with tokenbroker configuration files",
	}
	cmd.AddCommand(newConfigValidateCommand())
	return cmd
}

func newConfigValidateCommand() *cobra.Command {
	var kind string
	cmd := &cobra.Command{
		Use:   "validate FILE... [--kind auto|policy|agent|serve]",
		Short: "Check configuration files and print every problem with its field path",
		Long: `Check configuration files the way the programs that read them do, and print
every problem at once, one per line:

  FILE: field.path: message

Exit status 1 if there is any problem, else "FILE: valid <kind> config" and
exit status 0. Files that cannot be read are errors (exit status 1).

Kinds (--kind auto, the default, tells them apart by their top-level keys):

  policy  the broker's policy file (serve --policy-file, docs/policy.md):
          unknown fields, wrong types and every rule of the policy; a
          cluster.caFile that exists here must be a PEM bundle of
          certificates; one that does not exist here is only noted on
          stderr, since it is read where the broker runs.
  agent   the agent's config file (agent --config, docs/agent.md): unknown
          fields, wrong types and every rule of the agent's loader.
  serve   the YAML file of serve --config, whose keys are serve's flag
          names: unknown keys, values that do not parse as the flag's type,
          and serve's checks of the values given. Required flags the file
          leaves out are not problems: flags or TOKENBROKER_* variables may
          give them.

Field paths are those of the loaders' own messages:
peers[0].grants[1].maxTTL, targets[0].outputs[0].secret.format, gc-interval.`,
		Example: `  tokenbroker config validate deploy/base/policy.yaml
  tokenbroker config validate deploy/agent/agent.yaml
  tokenbroker config validate --kind serve /etc/tokenbroker/broker.yaml

  # in CI, every configuration of an overlay
  tokenbroker config validate overlays/east/policy.yaml overlays/west/agent.yaml`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, files []string) error {
			return runConfigValidate(files, kind, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
		ValidArgsFunction: func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
			return []string{"yaml", "yml", "json"}, cobra.ShellCompDirectiveFilterFileExt
		},
	}
	cmd.Flags().StringVar(&kind, "kind", kindAuto, "kind of file: auto, policy, agent or serve")
	_ = cmd.RegisterFlagCompletionFunc("kind", cobra.FixedCompletions(configKinds, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}

// runConfigValidate validates every file, prints its problems to out and
// its notes to errOut, and fails if any file has a problem or cannot be
// read.
func runConfigValidate(files []string, kind string, out, errOut io.Writer) error {
	valid := false
	for _, k := range configKinds {
		valid = valid || k == kind
	}
	if !valid {
		return fmt.Errorf("--kind must be one of %s, not %q", strings.Join(configKinds, ", "), kind)
	}
	var errs []error
	for _, file := range files {
		res, err := validateConfigFile(file, kind)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, n := range res.Notes {
			fmt.Fprintln(errOut, formatProblem(file, n))
		}
		for _, p := range res.Problems {
			fmt.Fprintln(out, formatProblem(file, p))
		}
		if len(res.Problems) > 0 {
			errs = append(errs, fmt.Errorf("%s: %d %s in this %s config", file, len(res.Problems), plural(len(res.Problems), "problem"), res.Kind))
			continue
		}
		fmt.Fprintf(out, "%s: valid %s config\n", file, res.Kind)
	}
	return errors.Join(errs...)
}

func formatProblem(file string, p apiv1.FieldError) string {
	if p.Field == "" {
		return file + ": " + p.Detail
	}
	return file + ": " + p.Field + ": " + p.Detail
}

func plural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}

// validationResult is what validateConfigFile found in one file.
type validationResult struct {
	Kind string
	// Problems make the file invalid, sorted by field path.
	Problems []apiv1.FieldError
	// Notes are what could not be checked here.
	Notes []apiv1.FieldError
}

// validateConfigFile reads path and checks it as the given kind (or the
// kind its keys say, for kindAuto). The error is for a file that cannot be
// read or whose kind cannot be told; everything wrong inside the file is a
// problem.
func validateConfigFile(path, kind string) (validationResult, error) {
	data, err := readConfigFile(path)
	if err != nil {
		return validationResult{}, err
	}
	res := validationResult{Kind: kind}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		if res.Kind == kindAuto {
			res.Kind = "YAML"
		}
		res.Problems = []apiv1.FieldError{{Detail: "not valid YAML: " + strings.TrimPrefix(err.Error(), "error converting YAML to JSON: ")}}
		return res, nil
	}
	var doc any
	if err := json.Unmarshal(js, &doc); err != nil {
		return validationResult{}, fmt.Errorf("%s: %w", path, err)
	}
	if res.Kind == kindAuto {
		if res.Kind, err = detectKind(doc); err != nil {
			return validationResult{}, fmt.Errorf("%s: %w", path, err)
		}
	}
	switch res.Kind {
	case kindPolicy:
		res.Problems, res.Notes = validatePolicy(path, doc)
	case kindAgent:
		res.Problems = validateAgentConfig(path, doc)
	case kindServe:
		res.Problems = validateServeConfig(path)
	default:
		return validationResult{}, fmt.Errorf("unknown kind %q", res.Kind)
	}
	sortProblems(res.Problems)
	return res, nil
}

func readConfigFile(path string) ([]byte, error) {
	data, err := readBoundedFile(path, maxConfigFileBytes)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	return data, nil
}

// detectKind tells the kind of a configuration by its top-level keys: the
// kind that knows the most of them, if only one does.
func detectKind(doc any) (string, error) {
	m, ok := doc.(map[string]any)
	if !ok || len(m) == 0 {
		return "", errors.New("not a YAML map of keys, so not a policy, agent or serve config")
	}
	known := map[string][]string{
		kindPolicy: jsonFieldNames(reflect.TypeFor[broker.Policy]()),
		kindAgent:  jsonFieldNames(reflect.TypeFor[agent.Config]()),
		kindServe:  serveFileKeys(),
	}
	best, bestScore, tie := "", 0, false
	for _, kind := range []string{kindPolicy, kindAgent, kindServe} {
		score := 0
		for k := range m {
			for _, name := range known[kind] {
				if strings.EqualFold(k, name) {
					score++
					break
				}
			}
		}
		switch {
		case score > bestScore:
			best, bestScore, tie = kind, score, false
		case score == bestScore && score > 0:
			tie = true
		}
	}
	if bestScore == 0 || tie {
		return "", errors.New("cannot tell whether this is a policy (cluster, ttl, peers), an agent config (identity, targets, ...) or a serve config (serve's flag names); give --kind")
	}
	return best, nil
}

// validatePolicy checks a policy document: its shape, the policy's rules
// (broker.ParsePolicy) and the CA bundle it names (as LoadPolicyFile does).
func validatePolicy(path string, doc any) (problems, notes []apiv1.FieldError) {
	var sc shapeChecker
	clean := sc.check("", doc, reflect.TypeFor[broker.Policy]())
	problems = sc.probs
	js, err := json.Marshal(clean)
	if err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()}), nil
	}
	_, err = broker.ParsePolicy(js)
	problems = append(problems, sc.without(loaderProblems(err))...)

	// The CA bundle, as LoadPolicyFile reads it. (Lenient decoding: the
	// shape problems are reported above.)
	var p broker.Policy
	_ = json.Unmarshal(js, &p)
	caChecked := true
	switch {
	case p.Cluster.CAFile != "" && p.Cluster.CAData != "":
	case p.Cluster.CAFile != "":
		caFile := p.Cluster.CAFile
		if !filepath.IsAbs(caFile) {
			caFile = filepath.Join(filepath.Dir(path), caFile)
		}
		data, err := readBoundedFile(caFile, maxConfigFileBytes)
		switch {
		case errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission):
			caChecked = false
			notes = append(notes, apiv1.FieldError{Field: "cluster.caFile", Detail: fmt.Sprintf("not checked: %v; the broker reads it where it runs", err)})
		case err != nil:
			problems = append(problems, apiv1.FieldError{Field: "cluster.caFile", Detail: err.Error()})
		default:
			if err := broker.CheckCABundle(data); err != nil {
				problems = append(problems, apiv1.FieldError{Field: "cluster.caFile", Detail: fmt.Sprintf("%s: %v", caFile, err)})
			}
		}
	case p.Cluster.CAData != "":
		if err := broker.CheckCABundle([]byte(p.Cluster.CAData)); err != nil {
			problems = append(problems, apiv1.FieldError{Field: "cluster.caData", Detail: err.Error()})
		}
	}
	// The broker's own loader has the last word, so that "valid" means
	// "serve would load it".
	if len(problems) == 0 && caChecked {
		if _, err := broker.LoadPolicyFile(path); err != nil {
			problems = append(problems, apiv1.FieldError{Detail: err.Error()})
		}
	}
	return problems, notes
}

// validateAgentConfig checks an agent config document: its shape and
// every rule of the agent's loader.
func validateAgentConfig(path string, doc any) []apiv1.FieldError {
	var sc shapeChecker
	clean := sc.check("", doc, reflect.TypeFor[agent.Config]())
	problems := sc.probs
	js, err := json.Marshal(clean)
	if err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()})
	}
	_, err = agent.ParseConfig(js, filepath.Dir(path))
	problems = append(problems, sc.without(loaderProblems(err))...)
	if len(problems) == 0 {
		if _, err := agent.LoadConfig(path); err != nil {
			problems = append(problems, apiv1.FieldError{Detail: err.Error()})
		}
	}
	return problems
}

// loaderProblems turns a loader's error into problems: its field problems
// if it has them, else the error itself.
func loaderProblems(err error) []apiv1.FieldError {
	if err == nil {
		return nil
	}
	if ve := (*apiv1.ValidationError)(nil); errors.As(err, &ve) {
		return ve.Problems
	}
	return []apiv1.FieldError{{Detail: err.Error()}}
}

// serveRequiredFlags are the flags serve requires; a config file may leave
// them to flags or the environment.
var serveRequiredFlags = []string{"tls-cert-file", "tls-key-file", "client-ca-file", "policy-file"}

// validateServeConfig checks the YAML file of "serve --config": the keys
// and value types as newViper checks them, then serve's own checks of the
// values the file gives.
func validateServeConfig(path string) []apiv1.FieldError {
	fv := viper.New()
	fv.SetConfigFile(path)
	if err := fv.ReadInConfig(); err != nil {
		return []apiv1.FieldError{{Detail: err.Error()}}
	}
	cmd := newServeCommand()
	problems, clean := flagFileProblems(cmd.Flags(), fv.AllSettings())

	// serve's checks, on the file's values and the defaults only: no
	// environment, and the required flags set to something, since flags
	// or the environment may give them.
	v := viper.New()
	cmd.Flags().VisitAll(func(f *pflag.Flag) { _ = v.BindPFlag(f.Name, f) })
	if err := v.MergeConfigMap(clean); err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()})
	}
	for _, k := range serveRequiredFlags {
		if _, ok := clean[k]; !ok {
			v.Set(k, "given-elsewhere")
		}
	}
	_, err := serveConfigFrom(v)
	for _, e := range unjoin(err) {
		problems = append(problems, flagProblem(e.Error()))
	}
	return problems
}

// unjoin returns the errors errors.Join joined, or err alone.
func unjoin(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, unjoin(e)...)
		}
		return out
	}
	return []error{err}
}

// flagProblem turns one of serve's messages ("--gc-interval must be at
// least 1s") into a problem of the key it names.
func flagProblem(msg string) apiv1.FieldError {
	rest, ok := strings.CutPrefix(msg, "--")
	if !ok {
		return apiv1.FieldError{Detail: msg}
	}
	end := strings.IndexAny(rest, " :")
	if end < 0 {
		return apiv1.FieldError{Detail: msg}
	}
	name, detail := rest[:end], strings.TrimLeft(rest[end:], " :")
	if strings.HasPrefix(detail, "and ") || detail == "" {
		detail = msg // "--a and --b go together" reads best whole
	}
	return apiv1.FieldError{Field: name, Detail: detail}
}

// serveFileKeys are the keys of a serve --config file: serve's flag names.
func serveFileKeys() []string {
	var keys []string
	newServeCommand().Flags().VisitAll(func(f *pflag.Flag) {
		if !notAFileKey(f.Name) {
			keys = append(keys, f.Name)
		}
	})
	return keys
}

// notAFileKey reports flags that a config file cannot set.
func notAFileKey(name string) bool { return name == "help" || name == "config" }

// unknownKey is the detail of a key nothing reads.
const unknownKey = "unknown key"

// flagFileProblems checks the settings of a config file whose keys are the
// flag names of fs: every key must be a flag and every value must parse as
// the flag's type (a duration as "30s", a number as a number). It returns
// the problems and the settings without the keys that have one.
func flagFileProblems(fs *pflag.FlagSet, settings map[string]any) ([]apiv1.FieldError, map[string]any) {
	var probs []apiv1.FieldError
	var names []string
	fs.VisitAll(func(f *pflag.Flag) {
		if !notAFileKey(f.Name) {
			names = append(names, f.Name)
		}
	})
	clean := map[string]any{}
	for _, k := range sortedKeys(settings) {
		f := fs.Lookup(k)
		if f == nil || notAFileKey(k) {
			probs = append(probs, apiv1.FieldError{Field: k, Detail: unknownKey + didYouMean(k, names)})
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

// shapeChecker compares a decoded YAML document with the Go type its
// loader decodes it into (with encoding/json, so json tags name the fields
// and matching is case-insensitive as there), and records every unknown
// field and every value of the wrong type, where the loader stops at the
// first.
type shapeChecker struct {
	probs []apiv1.FieldError
	// typed are the paths of values of the wrong type: the loader's
	// checks of them ("is required") would only repeat the problem.
	typed []string
}

var jsonUnmarshalerType = reflect.TypeFor[json.Unmarshaler]()

// check returns v without what does not fit t: unknown keys are left out,
// values of the wrong type become null (list elements keep their index, so
// that the loader's paths stay right).
func (c *shapeChecker) check(path string, v any, t reflect.Type) any {
	if v == nil {
		return nil
	}
	bad := func(format string, args ...any) any {
		c.probs = append(c.probs, apiv1.FieldError{Field: path, Detail: fmt.Sprintf(format, args...)})
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
		return c.check(path, v, t.Elem())
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
				c.probs = append(c.probs, apiv1.FieldError{Field: joinPath(path, k), Detail: "unknown field" + didYouMean(k, names)})
				continue
			}
			if nv := c.check(joinPath(path, f.name), m[k], f.typ); nv != nil {
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
			if nv := c.check(mapPath(path, k), m[k], t.Elem()); nv != nil {
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
			out[i] = c.check(fmt.Sprintf("%s[%d]", path, i), e, t.Elem())
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

// without drops the loader's problems about values the shape check already
// found of the wrong type, and anything under them.
func (c *shapeChecker) without(probs []apiv1.FieldError) []apiv1.FieldError {
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

func jsonFieldNames(t reflect.Type) []string {
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

// didYouMean suggests the known name closest to an unknown key, if one is
// close enough to be a typo.
func didYouMean(key string, known []string) string {
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

// sortProblems orders problems by field path, list indexes by number
// (peers[2] before peers[10]); problems of one field keep their order.
func sortProblems(probs []apiv1.FieldError) {
	key := func(p string) string {
		return indexInPath.ReplaceAllStringFunc(p, func(m string) string {
			n, _ := strconv.Atoi(m[1 : len(m)-1])
			return fmt.Sprintf("[%09d]", n)
		})
	}
	sort.SliceStable(probs, func(i, j int) bool { return key(probs[i].Field) < key(probs[j].Field) })
}

// readBoundedFile reads a file of at most limit bytes.
func readBoundedFile(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s is over %d bytes, the limit of the loaders", path, limit)
	}
	return data, nil
}
