package server

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// specFile is the wire contract these tests hold the server to.
const specFile = "../api/openapi.yaml"

// oaSpec is the part of an OpenAPI 3.1 document the tests read.
type oaSpec struct {
	OpenAPI    string                    `json:"openapi"`
	Security   []map[string][]string     `json:"security"`
	Paths      map[string]map[string]any `json:"paths"`
	Components oaComponents              `json:"components"`
}

type oaComponents struct {
	Schemas         map[string]*oaSchema `json:"schemas"`
	SecuritySchemes map[string]struct {
		Type string `json:"type"`
	} `json:"securitySchemes"`
}

type oaSchema struct {
	Ref        string               `json:"$ref"`
	Type       string               `json:"type"`
	Format     string               `json:"format"`
	Pattern    string               `json:"pattern"`
	Enum       []string             `json:"enum"`
	Required   []string             `json:"required"`
	Properties map[string]*oaSchema `json:"properties"`
	Items      *oaSchema            `json:"items"`
}

// httpMethods are the keys of an OpenAPI path item that are operations.
var httpMethods = map[string]string{
	"get": http.MethodGet, "put": http.MethodPut, "post": http.MethodPost, "delete": http.MethodDelete,
	"options": http.MethodOptions, "head": http.MethodHead, "patch": http.MethodPatch, "trace": http.MethodTrace,
}

func loadSpec(t *testing.T) *oaSpec {
	t.Helper()
	data, err := os.ReadFile(specFile)
	require.NoError(t, err)
	var s oaSpec
	require.NoError(t, yaml.Unmarshal(data, &s), "the spec must be valid YAML")
	require.True(t, strings.HasPrefix(s.OpenAPI, "3.1."), "OpenAPI 3.1, got %q", s.OpenAPI)
	return &s
}

// specOperations returns "METHOD /path" for every operation of the spec,
// split into those of the API listener and those of the operations listener
// (path items that override servers).
func specOperations(s *oaSpec) (api, ops []string) {
	for path, item := range s.Paths {
		_, onOps := item["servers"]
		for key := range item {
			m, ok := httpMethods[key]
			if !ok {
				continue
			}
			if onOps {
				ops = append(ops, m+" "+path)
			} else {
				api = append(api, m+" "+path)
			}
		}
	}
	sort.Strings(api)
	sort.Strings(ops)
	return api, ops
}

// enrollOperations returns "METHOD /path" for every operation whose own
// servers include one marked x-tokenbroker-listener: enroll.
func enrollOperations(t *testing.T, s *oaSpec) []string {
	t.Helper()
	var out []string
	for path, item := range s.Paths {
		for key, op := range item {
			m, ok := httpMethods[key]
			if !ok {
				continue
			}
			opMap, ok := op.(map[string]any)
			require.True(t, ok, "%s %s is not an object", m, path)
			servers, _ := opMap["servers"].([]any)
			for _, sv := range servers {
				if svMap, ok := sv.(map[string]any); ok && svMap["x-tokenbroker-listener"] == "enroll" {
					out = append(out, m+" "+path)
				}
			}
		}
	}
	sort.Strings(out)
	return out
}

// routeTable returns "METHOD /pattern" for every route of the chi table the
// server builds.
func routeTable(t *testing.T, r chi.Routes) []string {
	t.Helper()
	var out []string
	require.NoError(t, chi.Walk(r, func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		out = append(out, method+" "+route)
		return nil
	}))
	sort.Strings(out)
	return out
}

// diffSets says what is in want but not in got and the other way round.
func diffSets(wantName string, want []string, gotName string, got []string) []string {
	var probs []string
	for _, w := range want {
		if !slices.Contains(got, w) {
			probs = append(probs, fmt.Sprintf("%s has %q, %s does not", wantName, w, gotName))
		}
	}
	for _, g := range got {
		if !slices.Contains(want, g) {
			probs = append(probs, fmt.Sprintf("%s has %q, %s does not", gotName, g, wantName))
		}
	}
	return probs
}

func TestOpenAPIDescribesEveryRoute(t *testing.T) {
	t.Parallel()
	spec := loadSpec(t)
	h := newHarness(t, nil)
	routes := routeTable(t, h.srv.router)
	require.NotEmpty(t, routes)
	api, ops := specOperations(spec)

	t.Run("Every route of the chi table is in the spec with the same method, and the other way round.", func(t *testing.T) {
		t.Parallel()
		require.Empty(t, diffSets("the route table", routes, "api/openapi.yaml", api))
	})

	t.Run("The comparison notices a route missing from the spec.", func(t *testing.T) {
		t.Parallel()
		require.NotEmpty(t, diffSets("the route table", routes, "api/openapi.yaml", api[1:]))
		require.NotEmpty(t, diffSets("the route table", routes, "api/openapi.yaml", append(slices.Clone(api), "PUT /v1/whoami")))
	})

	t.Run("The operations paths of the spec are served by the operations handler, not by the API.", func(t *testing.T) {
		t.Parallel()
		require.ElementsMatch(t, []string{"GET /healthz", "GET /readyz", "GET /metrics"}, ops)
		for _, op := range ops {
			method, path, _ := strings.Cut(op, " ")
			rec := httptest.NewRecorder()
			h.srv.OpsHandler().ServeHTTP(rec, httptest.NewRequest(method, "http://ops.test"+path, nil))
			require.Equal(t, http.StatusOK, rec.Code, "%s on the operations handler: %s", op, rec.Body.String())
			require.Equal(t, http.StatusNotFound, h.do(request{method: method, path: path}).Code, "%s must not be on the API listener", op)
		}
	})

	t.Run("The enrollment listener serves exactly the operations the spec puts on it.", func(t *testing.T) {
		t.Parallel()
		enroll := enrollOperations(t, spec)
		require.ElementsMatch(t, []string{"POST /v1/certificates", "GET /v1/trust-bundle"}, enroll)
		require.Empty(t, diffSets("the enrollment route table", routeTable(t, h.srv.enrollRouter), "api/openapi.yaml (enroll)", enroll))
		require.Equal(t, "http", spec.Components.SecuritySchemes["joinToken"].Type)
	})

	t.Run("The API requires the mutualTLS security scheme.", func(t *testing.T) {
		t.Parallel()
		require.Equal(t, "mutualTLS", spec.Components.SecuritySchemes["mutualTLS"].Type)
		require.Equal(t, []map[string][]string{{"mutualTLS": {}}}, spec.Security)
	})
}

// wireTypes are the api/v1 types the spec describes, by schema name.
var wireTypes = []any{
	apiv1.KubeconfigRequest{}, apiv1.KubeconfigResponse{}, apiv1.Lease{}, apiv1.LeaseList{},
	apiv1.Grant{}, apiv1.WhoAmI{}, apiv1.CertificateInfo{}, apiv1.Problem{}, apiv1.FieldError{},
	apiv1.CertificateRequest{}, apiv1.CertificateResponse{}, apiv1.TrustBundle{}, apiv1.PeerLimits{}, apiv1.ExecKubeconfigResponse{},
	apiv1.LabelSelector{}, apiv1.LabelSelectorRequirement{},
	apiv1.WorkloadRef{}, apiv1.WorkloadInfo{}, apiv1.PeerJWKS{},
}

var timeType = reflect.TypeFor[time.Time]()

// compareSchema lists every difference between the json fields of Go type
// typ and the spec's schema of the same name: property names, required
// (exactly the fields without omitempty) and JSON types.
func compareSchema(spec *oaSpec, typ reflect.Type) []string {
	name := typ.Name()
	schema := spec.Components.Schemas[name]
	if schema == nil {
		return []string{fmt.Sprintf("schema %s is missing", name)}
	}
	var probs []string
	var fields, required []string
	for i := range typ.NumField() {
		f := typ.Field(i)
		tag, opts, _ := strings.Cut(f.Tag.Get("json"), ",")
		if !f.IsExported() || tag == "-" {
			continue
		}
		if tag == "" {
			tag = f.Name
		}
		fields = append(fields, tag)
		if !slices.Contains(strings.Split(opts, ","), "omitempty") {
			required = append(required, tag)
		}
		if prop := schema.Properties[tag]; prop != nil {
			probs = append(probs, compareType(spec, name+"."+tag, f.Type, prop)...)
		}
	}
	props := make([]string, 0, len(schema.Properties))
	for p := range schema.Properties {
		props = append(props, p)
	}
	probs = append(probs, diffSets("Go "+name, fields, "schema "+name+".properties", props)...)
	probs = append(probs, diffSets("Go "+name+" (fields without omitempty)", required, "schema "+name+".required", schema.Required)...)
	return probs
}

// compareType checks that the schema s of a property has the JSON type of
// Go type t.
func compareType(spec *oaSpec, where string, t reflect.Type, s *oaSchema) []string {
	if t.Kind() == reflect.Pointer {
		// An optional field: the pointer's target is what goes on the wire.
		return compareType(spec, where, t.Elem(), s)
	}
	if ref, ok := strings.CutPrefix(s.Ref, "#/components/schemas/"); ok {
		if t.Kind() == reflect.Struct && t != timeType {
			if ref != t.Name() {
				return []string{fmt.Sprintf("%s refers to %s, Go has %s", where, ref, t.Name())}
			}
			return nil
		}
		target := spec.Components.Schemas[ref]
		if target == nil {
			return []string{fmt.Sprintf("%s refers to missing schema %s", where, ref)}
		}
		s = target
	}
	want, format := "", ""
	switch {
	case t.Kind() == reflect.Bool:
		want = "boolean"
	case t.Kind() == reflect.Map:
		want = "object"
	case t == timeType:
		want, format = "string", "date-time"
	case t.Kind() == reflect.String:
		want = "string"
	case t.Kind() == reflect.Int:
		want = "integer"
	case t.Kind() == reflect.Bool:
		want = "boolean"
	case t.Kind() == reflect.Slice:
		if s.Type != "array" || s.Items == nil {
			return []string{fmt.Sprintf("%s is a Go slice, the spec says type %q", where, s.Type)}
		}
		return compareType(spec, where+"[]", t.Elem(), s.Items)
	case t.Kind() == reflect.Struct:
		return []string{fmt.Sprintf("%s is the Go struct %s, the spec has no $ref to it", where, t.Name())}
	default:
		return []string{fmt.Sprintf("%s has Go kind %s, which this test does not know", where, t.Kind())}
	}
	var probs []string
	if s.Type != want {
		probs = append(probs, fmt.Sprintf("%s is %s in Go, %q in the spec", where, want, s.Type))
	}
	if format != "" && s.Format != format {
		probs = append(probs, fmt.Sprintf("%s needs format %s, the spec says %q", where, format, s.Format))
	}
	return probs
}

func TestOpenAPISchemasMatchTheWireTypes(t *testing.T) {
	t.Parallel()
	spec := loadSpec(t)

	for _, v := range wireTypes {
		typ := reflect.TypeOf(v)
		t.Run("The schema "+typ.Name()+" has the json fields of api/v1."+typ.Name()+".", func(t *testing.T) {
			t.Parallel()
			require.Empty(t, compareSchema(spec, typ))
		})
	}

	t.Run("The comparison notices a renamed, a missing and a retyped property.", func(t *testing.T) {
		t.Parallel()
		broken := loadSpec(t)
		lease := broken.Components.Schemas["Lease"]
		lease.Properties["leaseId"] = lease.Properties["id"]
		delete(lease.Properties, "id")
		require.NotEmpty(t, compareSchema(broken, reflect.TypeFor[apiv1.Lease]()))

		req := broken.Components.Schemas["KubeconfigRequest"]
		req.Required = append(req.Required, "ttl")
		require.NotEmpty(t, compareSchema(broken, reflect.TypeFor[apiv1.KubeconfigRequest]()))

		broken.Components.Schemas["Problem"].Properties["status"] = &oaSchema{Type: "string"}
		require.NotEmpty(t, compareSchema(broken, reflect.TypeFor[apiv1.Problem]()))
	})

	t.Run("The enums are the constants of the code.", func(t *testing.T) {
		t.Parallel()
		creds := []string{apiv1.CredentialToken, apiv1.CredentialClientCertificate}
		s := spec.Components.Schemas
		require.ElementsMatch(t, creds, s["KubeconfigRequest"].Properties["credential"].Enum)
		require.ElementsMatch(t, creds, s["Lease"].Properties["credential"].Enum)
		require.ElementsMatch(t, creds, s["Grant"].Properties["credential"].Enum)
		require.ElementsMatch(t,
			[]string{policy.ClampedByGrant, policy.ClampedByPolicy, policy.ClampedByLeaseMinimum, policy.ClampedByAPIServer, policy.ClampedBySigner},
			s["KubeconfigResponse"].Properties["clampedBy"].Enum)
	})

	t.Run("The Problem types are exactly the ones writeError can emit.", func(t *testing.T) {
		t.Parallel()
		slugs := problemSlugs(t)
		var types []string
		for _, s := range slugs {
			types = append(types, problemTypePrefix+s)
		}
		require.ElementsMatch(t, types, spec.Components.Schemas["Problem"].Properties["type"].Enum)
	})
}

// problemSlugs returns the slug of every problemClass literal in errors.go,
// so that a class added there without the spec fails this test.
func problemSlugs(t *testing.T) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), "errors.go", nil, 0)
	require.NoError(t, err)
	var slugs []string
	ast.Inspect(f, func(n ast.Node) bool {
		lit, ok := n.(*ast.CompositeLit)
		if !ok {
			return true
		}
		if id, ok := lit.Type.(*ast.Ident); !ok || id.Name != "problemClass" || len(lit.Elts) < 2 {
			return true
		}
		bl, ok := lit.Elts[1].(*ast.BasicLit)
		require.True(t, ok && bl.Kind == token.STRING, "the second element of a problemClass literal is its slug")
		s, err := strconv.Unquote(bl.Value)
		require.NoError(t, err)
		slugs = append(slugs, s)
		return true
	})
	require.GreaterOrEqual(t, len(slugs), 10, "errors.go no longer declares problemClass literals as this test expects")
	return slugs
}

func TestOpenAPIPatternsAgreeWithTheValidators(t *testing.T) {
	t.Parallel()
	spec := loadSpec(t)
	durPattern := regexp.MustCompile(spec.Components.Schemas["GoDuration"].Pattern)
	idPattern := regexp.MustCompile(spec.Components.Schemas["LeaseID"].Pattern)

	durations := []struct {
		in             string
		pattern, valid bool
	}{
		{"2h", true, true},
		{"90m", true, true},
		{"1h30m", true, true},
		{"1.5h", true, true},
		{".5h", true, true},
		{"+2h", true, true},
		{"500ms", true, true},
		{"3µs", true, true},
		{"8760h", true, true},
		{"0h", true, false},    // not positive
		{"8761h", true, false}, // over the bound
		{"0", false, false},
		{"2", false, false},
		{"-2h", false, false},
		{"2d", false, false},
		{"P1D", false, false},
		{"h", false, false},
		{".h", false, false},
		{"2 h", false, false},
		{"2H", false, false},
	}
	for _, d := range durations {
		t.Run(fmt.Sprintf("The duration %q matches the pattern: %v; the server accepts it: %v.", d.in, d.pattern, d.valid), func(t *testing.T) {
			t.Parallel()
			require.Equal(t, d.pattern, durPattern.MatchString(d.in))
			fields := validateKubeconfigRequest(apiv1.KubeconfigRequest{Namespace: "ns", ServiceAccount: "sa", TTL: d.in})
			require.Equal(t, d.valid, len(fields) == 0, "%v", fields)
		})
	}

	ids := []string{testLeaseID, "q3fcxb7kumyz4pa2m6dxx5jnle", "abc", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxy1", "abcdefghijklmnopqrstuvwxyza"}
	for _, id := range ids {
		t.Run(fmt.Sprintf("The lease id %q matches the pattern exactly when apiv1.ValidLeaseID accepts it.", id), func(t *testing.T) {
			t.Parallel()
			require.Equal(t, apiv1.ValidLeaseID(id), idPattern.MatchString(id))
		})
	}
}
