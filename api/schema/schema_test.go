package schema

import (
	"reflect"
	"testing"
	"time"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

type server struct {
	Name    string            `json:"name"`
	Port    int               `json:"port"`
	Labels  map[string]string `json:"labels,omitempty"`
	Timeout apiv1.Duration    `json:"timeout,omitempty"`
	Peers   []struct {
		Identity string `json:"identity"`
	} `json:"peers,omitempty"`
}

type client struct {
	Target string `json:"target"`
}

func kinds() []Kind {
	check := func(t reflect.Type) func(string, any) ([]apiv1.FieldError, []apiv1.FieldError) {
		return func(_ string, doc any) ([]apiv1.FieldError, []apiv1.FieldError) {
			var c Checker
			c.Check("", doc, t)
			return c.Problems, nil
		}
	}
	return []Kind{
		{Name: "server", Description: "a server (name, port)", Keys: FieldNames(reflect.TypeFor[server]()), Check: check(reflect.TypeFor[server]())},
		{Name: "client", Description: "a client (target)", Keys: FieldNames(reflect.TypeFor[client]()), Check: check(reflect.TypeFor[client]())},
	}
}

func TestEveryProblemOfADocumentIsReportedWithItsPath(t *testing.T) {
	doc := "name: a\nprot: 8443\nport: 1.5\ntimeout: forever\nlabels: {app.kubernetes.io/name: [x]}\npeers: [{identity: 1}, {identiy: b}]\n"
	res, err := CheckDocument("f.yaml", []byte(doc), "", kinds())
	require.NoError(t, err)
	require.Equal(t, "server", res.Kind, "told apart by its keys")
	got := map[string]string{}
	for _, p := range res.Problems {
		got[p.Field] = p.Detail
	}
	require.Equal(t, `unknown field (did you mean "port"?)`, got["prot"])
	require.Equal(t, "must be a whole number, not the number 1.5", got["port"])
	require.Contains(t, got["timeout"], "must be a duration")
	require.Equal(t, "must be a string, not a list", got[`labels["app.kubernetes.io/name"]`])
	require.Equal(t, "must be a string, not the number 1", got["peers[0].identity"])
	require.Equal(t, `unknown field (did you mean "identity"?)`, got["peers[1].identiy"])
	require.Len(t, res.Problems, 6, "%v", res.Problems)
}

func TestAKindThatCannotBeToldIsAnError(t *testing.T) {
	_, err := CheckDocument("f.yaml", []byte("name: a\ntarget: b\n"), "", kinds())
	require.ErrorContains(t, err, "cannot tell whether this is a server (name, port) or a client (target)")
	_, err = CheckDocument("f.yaml", []byte("- a\n"), "", kinds())
	require.ErrorContains(t, err, "not a YAML map of keys, so not a server or client config")
	res, err := CheckDocument("f.yaml", []byte("name: [\n"), "", kinds())
	require.NoError(t, err)
	require.Contains(t, res.Problems[0].Detail, "not valid YAML")
	_, err = CheckDocument("f.yaml", []byte("name: a\n"), "proxy", kinds())
	require.ErrorContains(t, err, `unknown kind "proxy"`)
}

func TestAFlagFileNeedsKnownKeysAndValuesOfTheFlagsTypes(t *testing.T) {
	fs := pflag.NewFlagSet("x", pflag.ContinueOnError)
	fs.Duration("gc-interval", time.Minute, "")
	fs.Int("kube-burst", 1, "")
	fs.String("config", "", "")
	probs, clean := FlagFileProblems(fs, map[string]any{"gc-interval": 60, "kube-brust": 2, "config": "x", "kube-burst": "7"})
	got := map[string]string{}
	for _, p := range probs {
		got[p.Field] = p.Detail
	}
	require.Equal(t, `must be a duration such as "30s" (a string with a unit), not the number 60`, got["gc-interval"])
	require.Equal(t, UnknownKey+` (did you mean "kube-burst"?)`, got["kube-brust"])
	require.Equal(t, UnknownKey, got["config"], "the config file cannot name another")
	require.Equal(t, map[string]any{"kube-burst": "7"}, clean)
}

func TestAURLAKubeconfigCarriesIsPlainHTTPSWithAHostAndNoSecrets(t *testing.T) {
	for s, want := range map[string]string{
		"https://east.example.com:6443":     "",
		"https://10.0.0.1/k8s/clusters/c-1": "",
		"http://east.example.com":           "bad scheme",
		"https://user:pw@east.example.com":  "must not have user info",
		"https://east.example.com:0":        "port must be a number from 1 to 65535",
		"https://east.example.com/?a=b":     "must not have a query",
		"https://east example.com":          "printable ASCII",
		"https://ex\u0430mple.com":          "printable ASCII",
		"https://under_score.example.com":   "host must be a DNS name or an IP address",
		"https://":                          "must have a host",
	} {
		got := URLProblem(s, "bad scheme", "https")
		if want == "" {
			require.Empty(t, got, s)
			continue
		}
		require.Contains(t, got, want, s)
		require.NotContains(t, got, "pw", "the detail never repeats the URL")
	}
}
