package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/tokenbroker/tokenbroker/pki"
)

// validateArgs runs "tokenbroker config validate" with args and returns
// its stdout, stderr and whether it failed (exit status 1).
func validateArgs(t *testing.T, args ...string) (stdout, stderr string, failed bool) {
	t.Helper()
	cmd := newRootCommand()
	var out, errOut bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&errOut)
	cmd.SetArgs(append([]string{"config", "validate"}, args...))
	err := cmd.Execute()
	if err != nil {
		errOut.WriteString(err.Error())
	}
	return out.String(), errOut.String(), err != nil
}

func writeTemp(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	return p
}

const badPolicy = `cluster:
  name: East_1
  server: http://east.example.com
  caData: not a certificate
ttl:
  default: 5m
  max: forever
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - namespaces: [argo, 12]
        serviceAccount: [runner]
        maxTTL: 48h
        credential: password
  - name: west
    identity: not-a-spiffe-id
    certificateTTL: 1000h
    grant: []
  - "oops"
color: blue
`

const badAgent = `identity:
  dir: /x
  secret: {namespace: a, name: b}
  renewAt: 2
  enroll:
    broker: http://x
    caFingerprint: abc
refresh:
  fraction: "half"
  minBackoff: 10
targets:
  - name: East
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAcount: x, ttl: 1h, minTTL: 2h}
    outputs:
      - secret: {namespace: argo, name: east, format: yaml, labels: {app.kubernetes.io/managed-by: me}}
      - file: {path: /tmp/x/}
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: x}
    outputs: []
opsAddr: ":9091"
`

const badServe = `listen-address: ":8443"
kube-qsp: 50
kube-burst: lots
gc-interval: 60
pprof: yes-please
credentials: {a: b}
client-cert-ttl: 1000h
ca-cert-file: /ca.crt
namespace: Not_A_NS
policy-file: /p.yaml
`

func TestConfigValidateReportsEveryProblemWithItsFieldPath(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, file, content string
		args                []string
		want                []string // "field: start of the message"
		kind                string
	}{
		{
			name: "a policy with problems in every part", file: "policy.yaml", content: badPolicy, kind: "policy",
			want: []string{
				"cluster.caData: no PEM certificate in CA bundle",
				"cluster.name: a lowercase RFC 1123 label",
				"cluster.server: must be an https:// URL",
				"color: unknown field",
				"peers[0].grants[0].credential: must be \"token\" or \"clientCertificate\"",
				"peers[0].grants[0].maxTTL: must be between 10m0s and ttl.max",
				"peers[0].grants[0].namespaces[1]: must be a string, not the number 12",
				`peers[0].grants[0].serviceAccount: unknown field (did you mean "serviceAccounts"?)`,
				"peers[0].grants[0].serviceAccounts: must list at least one ServiceAccount",
				"peers[1].certificateTTL: must be between 10m0s and 720h0m0s",
				`peers[1].grant: unknown field (did you mean "grants"?)`,
				`peers[1].identity: "not-a-spiffe-id" is not a cluster identity`,
				`peers[1].name: duplicate peer name "west"`,
				`peers[2]: must be a map of fields, not the string "oops"`,
				"ttl.default: must be between 10m0s and ttl.max",
				`ttl.max: must be a duration such as "1h": time: invalid duration "forever"`,
			},
		},
		{
			name: "an agent config with problems in every part", file: "agent.yaml", content: badAgent, kind: "agent",
			want: []string{
				"identity: give one of dir, secret and podCertificate",
				"identity.enroll.broker: must be an https://host[:port] URL",
				"identity.enroll.caFingerprint: must be \"sha256:\" and 64 hex digits",
				"identity.enroll.tokenFile: is required",
				"identity.renewAt: must be between 0 and 1 (exclusive), not 2",
				`opsAddr: unknown field (did you mean "opsAddress"?)`,
				`refresh.fraction: must be a number, not the string "half"`,
				`refresh.minBackoff: must be a duration string such as "1h"`,
				"targets[0].name: must be a DNS label",
				`targets[0].outputs[0].secret.format: unknown format "yaml"`,
				`targets[0].outputs[0].secret.labels: "app.kubernetes.io/managed-by" is set by the agent`,
				"targets[0].outputs[1].file.path: must name a file, not a directory",
				"targets[0].request.minTTL: must not be longer than ttl",
				"targets[0].request.serviceAccount: is required",
				`targets[0].request.serviceAcount: unknown field (did you mean "serviceAccount"?)`,
				"targets[1].outputs: at least one output is required",
			},
		},
		{
			name: "a serve config file with unknown keys, bad types and bad values", file: "broker.yaml", content: badServe, kind: "serve",
			want: []string{
				"ca-cert-file: --ca-cert-file and --ca-key-file go together",
				"client-cert-ttl: must be between 10m0s and 720h0m0s",
				"credentials: must be a list of strings, not a map",
				`gc-interval: must be a duration such as "30s" (a string with a unit), not the number 60`,
				`kube-burst: must be a whole number, not the string "lots"`,
				`kube-qsp: unknown key (did you mean "kube-qps"?)`,
				`namespace: "Not_A_NS": a lowercase RFC 1123 label`,
				`pprof: must be true or false, not the string "yes-please"`,
			},
		},
		{
			name: "a policy with a misspelt namespace selector", file: "selector.yaml", kind: "policy",
			content: "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n" +
				"  - {name: t, namespaceSelector: {matchLabel: {a: b}, matchExpressions: [{key: k, operator: In, value: [x]}]}, serviceAccounts: [sa], revokeOnUnmatch: 'no'}\n" +
				"  - {namespaceSelector: {}, serviceAccounts: [sa]}\n",
			want: []string{
				"cluster.caData: no PEM certificate in CA bundle",
				`peers[0].grants[0].namespaceSelector.matchExpressions[0].value: unknown field (did you mean "values"?)`,
				"peers[0].grants[0].namespaceSelector.matchExpressions[0].values: Required value",
				`peers[0].grants[0].namespaceSelector.matchLabel: unknown field (did you mean "matchLabels"?)`,
				`peers[0].grants[0].revokeOnUnmatch: must be true or false, not the string "no"`,
				"peers[0].grants[1].name: is required with namespaceSelector",
				"peers[0].grants[1].namespaceSelector: must have matchLabels or matchExpressions",
			},
		},
		{
			name: "a policy whose namespace owner is incomplete or misspelt", file: "owner.yaml", kind: "policy",
			content: "cluster: {name: a, server: 'https://a', caData: x}\npeers:\n- name: w\n  identity: spiffe://a/cluster/w\n  grants:\n" +
				"  - {name: t, namespaceSelector: {matchLabels: {a: b}}, serviceAccounts: [sa], namespaceOwner: {apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uuid: x}}\n" +
				"  - {name: u, namespaceSelector: {matchLabels: {a: b}}, serviceAccounts: [sa], namespaceOwner: {apiVersion: capsule.clastix.io/v1beta2, kind: Tenant, name: oil, uid: oil}}\n",
			want: []string{
				"cluster.caData: no PEM certificate in CA bundle",
				"peers[0].grants[0].namespaceOwner.uid: is required: the owner's metadata.uid (kubectl get <kind> <name> -o jsonpath='{.metadata.uid}'), which no object created later can have",
				`peers[0].grants[0].namespaceOwner.uuid: unknown field (did you mean "uid"?)`,
				"peers[0].grants[1].namespaceOwner.uid: must be a UID as Kubernetes writes it (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)",
			},
		},
		{
			name: "an empty policy named by --kind", file: "empty.yaml", content: "", args: []string{"--kind", "policy"}, kind: "policy",
			want: []string{
				"cluster.caFile: is required (or cluster.caData)",
				"cluster.name: is required",
				"cluster.server: is required",
			},
		},
		{
			name: "a policy whose document is a list", file: "list.yaml", content: "- cluster\n", args: []string{"--kind", "policy"}, kind: "policy",
			want: []string{"must be a map of fields, not a list"},
		},
		{
			name: "a file that is not YAML", file: "broken.yaml", content: "a: [\n", kind: "YAML",
			want: []string{"not valid YAML: yaml: line 1"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			file := writeTemp(t, tc.file, tc.content)
			stdout, stderr, failed := validateArgs(t, append(tc.args, file)...)
			require.True(t, failed, "exit status 1")
			lines := strings.Split(strings.TrimSpace(stdout), "\n")
			for _, w := range tc.want {
				found := false
				for _, l := range lines {
					found = found || strings.HasPrefix(l, file+": "+w)
				}
				require.True(t, found, "missing line %q in\n%s", file+": "+w, stdout)
			}
			require.Len(t, lines, len(tc.want), "one line per problem, nothing else:\n%s", stdout)
			require.Contains(t, stderr, tc.kind+" config")
		})
	}
}

func TestConfigValidateAcceptsTheDeployedConfigs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ file, kind string }{
		{"../../deploy/base/policy.yaml", "policy"},
		{"../../deploy/agent/agent.yaml", "agent"},
	} {
		stdout, stderr, failed := validateArgs(t, tc.file)
		require.False(t, failed, stdout+stderr)
		require.Equal(t, tc.file+": valid "+tc.kind+" config\n", stdout)
		if tc.kind == "policy" {
			// Its caFile is the pod's in-cluster CA: noted, not a problem.
			require.Contains(t, stderr, "cluster.caFile: not checked")
		}
	}
}

func TestConfigValidateChecksACAFileThatExistsHere(t *testing.T) {
	t.Parallel()
	ca, err := pki.NewCA(pki.CAOptions{CommonName: "test"})
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "good.crt"), ca.CertPEM(), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "bad.crt"), []byte("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"), 0o600))
	pol := func(name, caFile string) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte("cluster: {name: east, server: 'https://east.example.com', caFile: "+caFile+"}\n"), 0o600))
		return p
	}

	good := pol("good.yaml", "good.crt")
	stdout, stderr, failed := validateArgs(t, good)
	require.False(t, failed, stdout+stderr)
	require.Equal(t, good+": valid policy config\n", stdout)
	require.Empty(t, stderr)

	bad := pol("bad.yaml", "bad.crt")
	stdout, _, failed = validateArgs(t, bad)
	require.True(t, failed)
	require.Contains(t, stdout, bad+`: cluster.caFile: `+filepath.Join(dir, "bad.crt")+`: unexpected PEM block "PRIVATE KEY" in CA bundle`)
}

func TestConfigValidateTellsTheKindsApartOrSaysItCannot(t *testing.T) {
	t.Parallel()
	for content, want := range map[string]string{
		"cluster: {}\npeers: []\n":                "policy",
		"identity: {dir: x}\ntargets: []\n":       "agent",
		"policy-file: p.yaml\nkube-qps: 5\n":      "serve",
		"kubeconfig: x\nidentity: {}\nfoo: bar\n": "agent",
		"kubeconfig: x\n":                         "",
		"hello: world\n":                          "",
		"":                                        "",
		"- a list\n":                              "",
		"Cluster: {}\nTTL: {}\n# keys as json matches them\n": "policy",
	} {
		kind, err := validateConfigFile(writeTemp(t, "c.yaml", content), kindAuto)
		if want == "" {
			require.Error(t, err, content)
			continue
		}
		require.NoError(t, err, content)
		require.Equal(t, want, kind.Kind, content)
	}
}

func TestConfigValidateFailsClearlyOnWhatItCannotRead(t *testing.T) {
	t.Parallel()
	_, stderr, failed := validateArgs(t, filepath.Join(t.TempDir(), "missing.yaml"))
	require.True(t, failed)
	require.Contains(t, stderr, "no such file or directory")

	_, stderr, failed = validateArgs(t, "--kind", "helm", writeTemp(t, "x.yaml", "a: b\n"))
	require.True(t, failed)
	require.Contains(t, stderr, `--kind must be one of auto, policy, agent, serve, not "helm"`)

	big := writeTemp(t, "big.yaml", "a: "+strings.Repeat("x", maxConfigFileBytes)+"\n")
	_, stderr, failed = validateArgs(t, big)
	require.True(t, failed)
	require.Contains(t, stderr, "over 1048576 bytes")
}

func TestServeRefusesAConfigFileValueOfTheWrongTypeLikeValidateDoes(t *testing.T) {
	t.Parallel()
	file := writeTemp(t, "serve.yaml", "gc-interval: 60\npprof: yes-please\nkube-qsp: 1\n")
	_, err := serveConfigOf(t, append(required, "--config", file)...)
	require.ErrorContains(t, err, `gc-interval: must be a duration such as "30s"`)
	require.ErrorContains(t, err, `pprof: must be true or false`)
	require.ErrorContains(t, err, `unknown key "kube-qsp" (did you mean "kube-qps"?)`)

	stdout, _, failed := validateArgs(t, file)
	require.True(t, failed)
	require.Contains(t, stdout, `gc-interval: must be a duration such as "30s"`)
}

func TestAServeConfigFileThatLeavesRequiredFlagsToTheCommandLineIsValid(t *testing.T) {
	t.Parallel()
	file := writeTemp(t, "serve.yaml", "gc-interval: 30s\nkube-qps: 50\ncredentials: [token]\nlog-format: console\n")
	stdout, stderr, failed := validateArgs(t, "--kind", "serve", file)
	require.False(t, failed, stdout+stderr)
	require.Equal(t, file+": valid serve config\n", stdout)
}

func TestConfigValidateExplainsWhichJoinTokensAServeConfigRefuses(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		content string
		want    string // on stderr; "" means no note
	}{
		{name: "an enrollment listener notes that tokens must name the policy's cluster.name",
			content: "enroll-address: ':8444'\nca-cert-file: ca.crt\nca-key-file: ca.key\n", want: `enroll-address: join tokens must name this broker: make them with "pki join-token --audience" the policy's cluster.name; tokens without an audience (made before the upgrade) are refused (401) unless accept-unbound-join-tokens: true`},
		{name: "configured broker names are the audiences to use",
			content: "enroll-address: ':8444'\nca-cert-file: ca.crt\nca-key-file: ca.key\nbroker-name: [east-a, east-b]\n", want: `--audience" east-a or east-b;`},
		{name: "accepting unbound tokens notes the replay it allows",
			content: "enroll-address: ':8444'\nca-cert-file: ca.crt\nca-key-file: ca.key\naccept-unbound-join-tokens: true\n", want: "accept-unbound-join-tokens: join tokens that name no broker are accepted"},
		{name: "without an enrollment listener there is nothing to note", content: "gc-interval: 2m\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			file := writeTemp(t, "broker.yaml", tc.content)
			stdout, stderr, failed := validateArgs(t, "--kind", "serve", file)
			require.False(t, failed, stdout+stderr)
			require.Contains(t, stdout, "valid serve config")
			if tc.want == "" {
				require.Empty(t, stderr)
				return
			}
			require.Contains(t, stderr, tc.want)
		})
	}
}

func TestConfigValidateSaysWhatKeepsTheLeaseGatewayFromForwarding(t *testing.T) {
	t.Parallel()
	pol := writeTemp(t, "policy.yaml", `cluster: {name: east, server: 'https://east.example.com', caData: x}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - {namespaces: [argo], serviceAccounts: [runner], access: gateway}
`)
	t.Run("gateway grants without a gateway are answered 422", func(t *testing.T) {
		t.Parallel()
		file := writeTemp(t, "broker.yaml", "policy-file: "+pol+"\n")
		stdout, stderr, failed := validateArgs(t, "--kind", "serve", file)
		require.False(t, failed, stdout+stderr)
		require.Contains(t, stderr, "gateway-address: the policy ("+pol+") has 1 grant with access: gateway, but no gateway-address")
	})
	t.Run("the Pod flags of older charts are ignored, and said so", func(t *testing.T) {
		t.Parallel()
		file := writeTemp(t, "broker.yaml", "gateway-pod-name: tokenbroker-0\ngateway-pod-uid: 0f8fad5b-d9cb-469f-a165-70867728950e\n")
		stdout, stderr, failed := validateArgs(t, "--kind", "serve", file)
		require.False(t, failed, stdout+stderr)
		require.Contains(t, stderr, "gateway-pod-name: ignored: the gateway's upstream tokens are bound to each lease Secret")
		require.Contains(t, stderr, "gateway-pod-uid: ignored")
	})
}

func TestConfigValidateExplainsTheAudienceRefusal(t *testing.T) {
	t.Parallel()
	t.Run("an agent target that names audiences is told what its grant must list", func(t *testing.T) {
		t.Parallel()
		agent := writeTemp(t, "agent.yaml", `identity: {dir: /var/run/tokenbroker/identity}
targets:
  - name: east
    broker: https://east.example.com:8443
    request: {namespace: argo, serviceAccount: runner, audiences: [vault.example]}
    outputs:
      - file: {path: /tmp/east.kubeconfig}
`)
		stdout, stderr, failed := validateArgs(t, agent)
		require.False(t, failed, stdout+stderr)
		require.Equal(t, agent+": valid agent config\n", stdout)
		require.Contains(t, stderr, agent+": targets[0].request.audiences: the broker answers 403 to a request naming audiences (vault.example) unless its grant lists every one in grants[].audiences")
	})
	t.Run("a policy's audiences that cannot work are problems that say why", func(t *testing.T) {
		t.Parallel()
		pol := writeTemp(t, "policy.yaml", `cluster: {name: east, server: 'https://east.example.com', caData: x}
peers:
  - name: west
    identity: spiffe://oc.example/cluster/west
    grants:
      - {namespaces: [argo], serviceAccounts: [runner], audiences: ["*"]}
      - {namespaces: [flux], credential: clientCertificate, clusterRole: view, audiences: [vault.example]}
`)
		stdout, _, failed := validateArgs(t, pol)
		require.True(t, failed)
		require.Contains(t, stdout, pol+": peers[0].grants[0].audiences[0]: is not a wildcard: audiences are compared exactly, so list each one a peer may ask for")
		require.Contains(t, stdout, pol+": peers[0].grants[1].audiences: only a token grant lists audiences: a client certificate has none")
	})
}
