package execcred

import (
	"strings"
	"testing"
	"time"
)

// FuzzParseExecInfo feeds KUBERNETES_EXEC_INFO parser arbitrary input:
// it must never panic, must accept only the two versions it answers in,
// and every answer it then encodes must be one client-go reads. The seeds
// are client-go's requests and the regressions in
// testdata/fuzz/FuzzParseExecInfo.
func FuzzParseExecInfo(f *testing.F) {
	for _, s := range []string{
		`{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","spec":{"interactive":false}}`,
		`{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1beta1","spec":{"interactive":true}}`,
		`{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1","spec":{"cluster":{"server":"https://127.0.0.1:6443","certificate-authority-data":"LS0t","config":null},"interactive":false}}`,
		`{"apiVersion":"client.authentication.k8s.io/v1alpha1"}`,
		`{"apiVersion":1}`,
		`null`,
		`[]`,
		``,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		info, err := ParseExecInfo(data)
		if err != nil {
			if strings.Contains(err.Error(), "\n") {
				t.Fatalf("the error is not one line: %q", err)
			}
			return
		}
		if info.APIVersion != APIVersionV1 && info.APIVersion != APIVersionV1beta1 || !info.FromClientGo {
			t.Fatalf("accepted %+v", info)
		}
		out, err := Encode(info.APIVersion, Status{Token: "t", Expiration: time.Unix(1e9, 0)})
		if err != nil {
			t.Fatalf("cannot answer an accepted request: %v", err)
		}
		decodeLikeClientGo(t, info.APIVersion, out)
	})
}

// FuzzDecodeEntry feeds the cache file decoder arbitrary files: it must
// never panic, and what it accepts must be a usable entry of its key.
func FuzzDecodeEntry(f *testing.F) {
	const id = "0123456789abcdef"
	f.Add([]byte(`{"version":1,"key":"0123456789abcdef","broker":"https://b","leaseId":"abcdefghijklmnopqrstuvwxyz","token":"t",` +
		`"obtainedAt":"2030-01-02T03:04:05Z","expiresAt":"2030-01-02T04:04:05Z","refreshAt":"2030-01-02T03:44:05Z","servedTo":[{"pid":7,"startTime":9}]}`))
	f.Add([]byte(`{"version":2}`))
	f.Add([]byte(`{`))
	f.Fuzz(func(t *testing.T, data []byte) {
		e, ok := decodeEntry(data, id)
		if !ok {
			return
		}
		if e.Key != id || e.Token == "" && (e.ClientCertificateData == "" || e.ClientKeyData == "") ||
			!e.ObtainedAt.Before(e.RefreshAt) || e.RefreshAt.After(e.ExpiresAt) || len(e.ServedTo) > maxServedTo {
			t.Fatalf("accepted an unusable entry: %v", e)
		}
	})
}

// FuzzPluginTargetAndGuard feeds spec.cluster.config and the cluster
// client-go names arbitrary input: ParsePluginTarget must never panic and
// accept only a complete target of its version, and CheckCluster must
// never accept a server that is not the broker's.
func FuzzPluginTargetAndGuard(f *testing.F) {
	f.Add([]byte(`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b:8443","namespace":"n","serviceAccount":"s","ttl":"1h"}`), "https://east:6443")
	f.Add([]byte(`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":"n","x":1}`), "https://EAST:6443/")
	f.Add([]byte(`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget"}{}`), "https://east")
	f.Add([]byte(`null`), "https://[::1]:6443")
	f.Add([]byte(`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":"n","serviceAccount":"s","access":"gateway"}`), "https://gw:8445")
	f.Add([]byte(`{"apiVersion":"tokenbroker.io/v1","kind":"PluginTarget","broker":"https://b","namespace":"n","access":{"PluginTarget":1}}`), "https://east")
	f.Fuzz(func(t *testing.T, raw []byte, server string) {
		if tgt, err := ParsePluginTarget(raw); err == nil {
			if tgt.APIVersion != "tokenbroker.io/v1" || tgt.Kind != "PluginTarget" || tgt.Broker == "" || tgt.Namespace == "" {
				t.Fatalf("accepted an incomplete target %+v", tgt)
			}
			if tgt.Access != "" && tgt.Access != "direct" && tgt.Access != "gateway" {
				t.Fatalf("accepted an unknown access mode %q", tgt.Access)
			}
		} else if len(err.Error()) > 2048 {
			t.Fatalf("an unbounded error: %d bytes", len(err.Error()))
		}
		want := ClusterRef{Server: "https://east:6443", CAData: fuzzCA}
		if CheckCluster(Cluster{Server: server, CAData: fuzzCA}, want) == nil {
			if c, err := canonicalServer(server); err != nil || c != "https://east:6443" {
				t.Fatalf("the guard let %q through", server)
			}
		}
	})
}

// fuzzCA is a fixed CA certificate for FuzzPluginTargetAndGuard.
var fuzzCA = []byte(`-----BEGIN CERTIFICATE-----
MIIBdDCCARugAwIBAgIUduNIFkRLOxCSF5+Iimwt0BRiOoIwCgYIKoZIzj0EAwIw
DzENMAsGA1UEAwwEZWFzdDAgFw0yNjExMjUwODE4MTNaGA8yMTI2MTEwMTA4MTgx
M1owDzENMAsGA1UEAwwEZWFzdDBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABJ81
7nbVenstpIXMKjFVKIulAJHvX4lDv1k8MywE+Fv4DS87ZnFkSzoRHtNisnNVXy3j
ICOsahfxL3f2Ch+Zhs2jUzBRMB0GA1UdDgQWBBTGXTkNnrn7pzKEqGzxWYlVS9lX
kTAfBgNVHSMEGDAWgBTGXTkNnrn7pzKEqGzxWYlVS9lXkTAPBgNVHRMBAf8EBTAD
AQH/MAoGCCqGSM49BAMCA0cAMEQCIDGZqBdCQ5BIgyfdDZHJxcxHUycbu6mIlofW
UEOUizwBAiBO1fqax6KCt0k/7xAOMhlTJgmaQBzyBvF99blZcpw8pg==
-----END CERTIFICATE-----
`)
